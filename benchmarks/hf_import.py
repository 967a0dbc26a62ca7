"""Import time and peak host memory per rank when ranks read a ≥1B Hugging Face checkpoint by slices.

Makes (once) a random-weight Llama with tessera's llama-1b shape (1.24B parameters, bf16, sharded
safetensors of ≤1 GB with the index) with `transformers` on the meta device, then starts N processes at once,
each reading its 1/N row block of every parameter through `tessera.hf.weights.HFCheckpoint` (safetensors
``get_slice``), upcast to fp32 as the trainer holds them, and keeping it, as a rank of a ZeRO-3 or column-parallel
layout does. Reported per rank: wall time, peak resident memory (``ru_maxrss``: the fp32 shard plus the
memory-mapped file pages it touched) and the fp32 shard size. For comparison one process reads everything (what
every rank read before sharded construction, when the trainer filled the whole plain model first).

    python benchmarks/hf_import.py [--folder DIR] [--ranks 4]

Writes benchmarks/results/hf_import.md. Needs ~3 GB of disk and, with 4 ranks, ~8 GB of memory.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import time
from pathlib import Path

import torch

from tessera.config import load_config

RESULTS = Path(__file__).resolve().parent / "results" / "hf_import.md"


def make_folder(folder: Path) -> None:
    """A random-weight llama-1b-shaped LlamaForCausalLM in bf16, saved in ≤1 GB shards (skipped if present)."""
    if (folder / "model.safetensors.index.json").is_file():
        return
    import transformers

    from tessera.model.sizes import SIZES

    s = SIZES["llama-1b"]
    cfg = transformers.LlamaConfig(
        hidden_size=s["d_model"],
        intermediate_size=s["ffn_hidden"],
        num_hidden_layers=s["n_layers"],
        num_attention_heads=s["n_heads"],
        num_key_value_heads=s["n_kv_heads"],
        vocab_size=s["vocab_size"],
        max_position_embeddings=s["seq_len"],
        rope_theta=s["rope_theta"],
        tie_word_embeddings=s["tie_embeddings"],
        dtype="bfloat16",
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    model.save_pretrained(folder, max_shard_size="1GB")


def _read(folder: str, rank: int, world: int, queue) -> None:
    from tessera.hf.weights import HFCheckpoint
    from tessera.model.build import meta_model

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    cfg = load_config(None, [f'model.init="hf:{folder}"'])
    model = meta_model(cfg.model)
    held, nbytes = [], 0
    with HFCheckpoint(Path(folder), model) as source:
        for name, p in model.named_parameters():
            rows = -(-p.shape[0] // world)
            window = (slice(rank * rows, min((rank + 1) * rows, p.shape[0])),)
            held.append(source(name, window).float())
            nbytes += held[-1].numel() * 4
        seconds = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        private = _status_bytes("RssAnon")  # the process's own memory, while it holds its shard
    queue.put((rank, seconds, peak, private, nbytes, model.num_params()))


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def run(folder: Path, world: int) -> list[tuple]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_read, args=(str(folder), r, world, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(queue.get() for _ in procs)
    for p in procs:
        p.join()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", default=str(Path.home() / ".cache" / "tessera" / "hf-llama-1b"))
    ap.add_argument("--ranks", type=int, default=4)
    args = ap.parse_args()
    folder = Path(args.folder)
    make_folder(folder)
    files = sorted(folder.glob("*.safetensors"))
    on_disk = sum(f.stat().st_size for f in files)
    rows = [(f"{args.ranks} ranks, rank {r}", *rest) for r, *rest in run(folder, args.ranks)]
    rows += [("1 rank, everything", *run(folder, 1)[0][1:])]
    gib = 2**30
    lines = [
        "# Hugging Face import by slices: time and peak host memory per rank",
        "",
        f"Model: random-weight Llama, tessera's llama-1b shape ({rows[0][5] / 1e9:.2f}B parameters), bf16, "
        f"{len(files)} safetensors shards, {on_disk / gib:.2f} GiB on disk. Each rank reads its 1/N row block of "
        "every parameter with `HFCheckpoint` (safetensors `get_slice`) and holds it in fp32. Peak = `ru_maxrss`: "
        "private memory plus the memory-mapped file pages in the process's page table (page cache shared by all "
        "ranks, unmapped when the files are closed; the kernel maps pages around each one read, more so when "
        "other ranks have already loaded them). Private = `RssAnon` while holding the shard: the fp32 shard and "
        "the interpreter with torch (~0.2 GiB). Measured on a shared 2-core CPU machine with all ranks at once, "
        "so times are an upper bound.",
        "",
        "Command: `python benchmarks/hf_import.py --ranks " + str(args.ranks) + "`",
        "",
        "| reader | time (s) | peak host memory (GiB) | private memory (GiB) | fp32 shard (GiB) |",
        "|---|---|---|---|---|",
        *(
            f"| {who} | {sec:.1f} | {peak / gib:.2f} | {own / gib:.2f} | {nb / gib:.2f} |"
            for who, sec, peak, own, nb, _ in rows
        ),
        "",
        "The trainer reads this way (sharded construction: each rank materialises only its slices from the "
        "folder); the last row is what every rank read when the whole plain model was filled first.",
    ]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
