"""The ``tessera`` command: thin subcommands over the library. Errors print as messages, never tracebacks."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.errors import EXIT_OUTPUT_CLOSED, EXIT_PEER_LOST, EXIT_RESUMABLE, TesseraError
from tessera.process_exit import finish_quickly_at_exit

if TYPE_CHECKING:
    from tessera.config import Config
    from tessera.planner.cost import Plan

__all__ = ["main"]


def _split_overrides(extra: list[str]) -> list[str]:
    """Keep ``--section.key=value`` / ``section.key=value`` items; anything else is a usage error."""
    bad = [x for x in extra if "=" not in x or "." not in x.split("=", 1)[0]]
    if bad:
        raise TesseraError(f"unrecognised arguments {bad}; overrides look like --train.lr=3e-4")
    return [x.lstrip("-") for x in extra]


def _load(args: argparse.Namespace, extra: list[str]):
    from tessera.config import load_config

    config = args.config
    if config is not None and config.startswith("--") and "=" in config:
        # argparse takes an argument holding a space (--parallel.stage_layers="[1, 3]") for a positional one
        config, extra = None, [config, *extra]
    return load_config(config, _split_overrides(extra))


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from tessera.rank_errors import decided_on_every_rank

    with decided_on_every_rank():  # from the command line and the config alone: the same on every rank
        cfg = _load(args, extra)
        if args.nproc < 1 or args.max_restarts < 0:
            raise TesseraError(
                f"--nproc {args.nproc} must be at least 1 and --max-restarts {args.max_restarts} >= 0"
            )
    if args.nproc > 1 and "RANK" not in os.environ:
        cfg.validate(args.nproc)
        stop = getattr(signal, cfg.train.stop_signal, None) if cfg.train.stop_signal else None
        beats = Path(cfg.log.run_dir) / "heartbeat"  # the trainer's watchdog writes each rank's step there
        return _relaunch_with_torchrun(
            args.nproc,
            stop_signals=(stop,) if stop else (),
            heartbeat_dir=beats,
            max_restarts=args.max_restarts,
        )
    # Reject a wrong config before the trainer's imports (torch: seconds) and the run directory's lock, as the
    # multi-process path above does; the trainer resolves the same plan again and would raise the same message.
    with decided_on_every_rank():
        cfg.validate(int(os.environ.get("WORLD_SIZE", "1")))
    from tessera.train.trainer import train

    result = train(cfg)
    if int(os.environ.get("RANK", 0)) != 0:
        return EXIT_RESUMABLE if result.stopped_by else 0
    if result.stopped_by:
        at = max(result.losses) + 1 if result.losses else result.resumed_from
        print(
            f"stopped cleanly on {result.stopped_by}: checkpoint of step {at} saved in {result.checkpoint_dir}; "
            f"run the same command to resume (exit status {EXIT_RESUMABLE})"
        )
        return EXIT_RESUMABLE
    if result.losses:
        first, last = result.losses[min(result.losses)], result.losses[max(result.losses)]
        print(f"done: loss {first:.4f} -> {last:.4f}; metrics in {result.run_dir}/metrics.jsonl")
    return 0


def _relaunch_with_torchrun(
    nproc: int, stop_signals: tuple[int, ...] = (), heartbeat_dir: Path | None = None, max_restarts: int = 0
) -> int:
    """``--nproc N`` on one machine: run this command in N local ranks (the environment torchrun would set).

    Unlike torchrun, a failing rank ends the others at once and the user sees one line naming it, after that
    rank's own error message, instead of a launcher traceback (tessera/train/launch.py).
    """
    from tessera.train.launch import launch_local

    i = sys.argv.index("--nproc") if "--nproc" in sys.argv else None
    argv = (
        sys.argv[1:i] + sys.argv[i + 2 :]
        if i is not None
        else [a for a in sys.argv[1:] if not a.startswith("--nproc")]
    )
    return launch_local(
        nproc, argv, stop_signals=stop_signals, heartbeat_dir=heartbeat_dir, max_restarts=max_restarts
    )


def cmd_validate(args: argparse.Namespace, extra: list[str]) -> int:
    from tessera.execution import resolve, violations

    cfg = _load(args, extra)
    problems = violations(cfg, args.world_size)
    if problems:
        print(
            f"{len(problems)} problem(s) with {args.config or 'the defaults'} at world size {args.world_size}:"
        )
        for i, v in enumerate(problems, 1):
            print(f"  {i}. {v}")
        return 1
    if args.data:
        _check_data(cfg)
    plan = resolve(cfg, args.world_size)
    print(
        f"ok: {plan.layout.describe()}; {plan.micro_batches} micro-batches of {plan.micro_batch} per "
        "data-parallel rank"
    )
    print("\n".join(f"  {line}" for line in plan.describe().splitlines()))
    _warn_long_documents(cfg)
    return 0


def _warn_long_documents(cfg: Config) -> None:
    """data.window_start = "document": the trainer's start-up warning about documents longer than a window, for
    the named training files (scans them for their document starts; the default corpus is judged when built)."""
    from tessera.train.data import long_documents, open_data

    d = cfg.data
    if d.window_start != "document" or not d.sources():
        return
    data, _ = open_data(d.sources(), d.valid_path, d.valid_fraction, d.window_start)
    warning = long_documents(data, cfg.model.seq_len, d.loss_mask)  # also caches the files' start index
    if warning:
        print(f"warning: {warning}")


def _check_data(cfg: Config) -> None:
    """`validate --data`: every token file's checksum and its ids against the model's vocabulary."""
    from tessera.train.data import TokenDataset

    paths = [p for p, _ in cfg.data.sources()] + ([cfg.data.valid_path] if cfg.data.valid_path else [])
    if not paths:
        raise TesseraError(
            "--data checks data.path, which is unset (the default corpus is checked when built)"
        )
    for path in paths:
        data = TokenDataset(path)
        data.verify()
        data.check_vocab(cfg.model.vocab_size)
        mask = (
            ""
            if data.mask is None
            else f", loss mask verified ({data.meta['loss_mask']['n_targets']:,} targets)"
        )
        print(
            f"data ok: {path}: {data.n_tokens:,} tokens, checksum verified, ids < {data.max_token_id + 1}{mask}"
        )


def cmd_prepare(args: argparse.Namespace) -> int:
    import warnings

    from tessera.train.data import PrepareNote, default_corpus_files, prepare

    if not args.inputs and not 0 < args.default_mb < float("inf"):  # also NaN
        raise TesseraError(f"--default-mb {args.default_mb} must be a positive number of MiB, e.g. 8")
    inputs = [Path(p) for p in args.inputs] or default_corpus_files(int(args.default_mb * 2**20))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            info = prepare(
                inputs,
                Path(args.out),
                args.tokenizer,
                text_key=args.text_key,
                prompt_key=args.prompt_key,
                completion_key=args.completion_key,
                messages_key=args.messages_key,
                tools_key=args.tools_key,
                eot_token=args.eot_token,
                workers=args.workers,
                strict=args.strict,
                progress=True,
            )
        finally:  # also before an error: why files were skipped explains "no text found"
            for w in caught:  # as messages, not as warnings pointing at a line of library code
                kind = "note" if issubclass(w.category, PrepareNote) else "warning"
                print(f"{kind}: {w.message}", file=sys.stderr)
    print(
        f"wrote {info['n_tokens']:,} tokens to {args.out} ({info['n_documents']:,} documents, vocab "
        f"{info['vocab_size']}; {info['n_skipped']} file(s) skipped, {info['n_bad_records']} bad record(s))"
    )
    if "loss_mask" in info:
        mask = info["loss_mask"]
        kept = (
            f"assistant turns and their end-of-turn tokens, by {mask['assistant_tokens']}"
            if "messages_key" in mask
            else "completions and their end-of-text tokens"
        )
        print(
            f"wrote its loss mask to {Path(args.out).with_name(mask['file'])}: {mask['n_targets']:,} target "
            f"tokens ({kept}) of {info['n_tokens']:,}; train on them with data.loss_mask = true"
        )
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from tessera import config_docs

    print(config_docs.markdown() if args.markdown else config_docs.text())
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from tessera.train.run_files import newest_weights

    _check_sampling(args)
    prompt = _generate_prompt(args)
    tools = _generate_tools(args)
    # Name a wrong run folder (no config.json, no checkpoint, only split weights) before torch's import (seconds);
    # generate_text looks the weights up again with the same function.
    newest_weights(Path(args.run))
    from tessera.train.generate import TokenProgress, generate_text

    # a line that redraws itself is for a person watching; a log or a pipe gets nothing new
    progress = TokenProgress(args.tokens, sys.stderr) if sys.stderr.isatty() else None
    try:
        text = generate_text(
            Path(args.run),
            prompt,
            args.tokens,
            args.temperature,
            args.top_k,
            args.seed,
            args.top_p,
            not args.no_kv_cache,
            on_token=progress,
            stop=args.stop,
            chat=args.chat,
            tools=tools,
        )
    finally:
        if progress is not None:
            progress.close()
    print(text)
    return 0


def _generate_prompt(args: argparse.Namespace) -> str | list[dict]:
    """generate's prompt: with --chat the conversation from --system, --messages and --prompt, checked before
    torch's import; otherwise --prompt's text (default "def ")."""
    if not args.chat:
        flags = (("--system", args.system), ("--messages", args.messages), ("--tools", args.tools))
        given = [f for f, v in flags if v is not None]
        if given:
            verb = "builds" if len(given) == 1 else "build"
            raise TesseraError(f"{' and '.join(given)} {verb} a chat prompt, which needs --chat; add --chat")
        return "def " if args.prompt is None else args.prompt
    from tessera.train.chat import chat_prompt  # numpy and json only

    return chat_prompt(args.prompt, args.system, args.messages)


def _generate_tools(args: argparse.Namespace) -> list[dict] | None:
    """generate --chat's --tools file, read and checked before torch's import (`_generate_prompt` refused it
    without --chat)."""
    if args.tools is None:
        return None
    from tessera.train.chat import chat_tools  # numpy and json only

    return chat_tools(args.tools)


def _check_sampling(args: argparse.Namespace) -> None:
    """generate's numbers, named before torch's import (torch would fail on them deep in sampling)."""
    problems = []
    if args.tokens < 1:
        problems.append(f"--tokens {args.tokens} must be at least 1 (the number of tokens to sample)")
    if not -math.inf < args.temperature < math.inf:
        problems.append(f"--temperature {args.temperature} must be a finite number (0 or less: greedy)")
    if args.top_k is not None and args.top_k < 1:
        problems.append(f"--top-k {args.top_k} must be at least 1; leave it out to keep every token")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        problems.append(f"--top-p {args.top_p} must be in (0, 1], e.g. 0.9")
    if not -(2**63) <= args.seed < 2**64:  # torch.Generator.manual_seed's range
        problems.append(f"--seed {args.seed} must fit in 64 bits, e.g. --seed 0")
    if problems:
        raise TesseraError("; ".join(problems))


def cmd_export(args: argparse.Namespace) -> int:
    from tessera.train.checkpoint_files import is_sharded
    from tessera.train.run_files import source_checkpoint, wrong_world_size

    if args.nproc is not None and args.nproc < 1:
        raise TesseraError(
            f"--nproc {args.nproc} must be at least 1; leave it out to start as many processes as the checkpoint "
            "needs"
        )
    if args.out is not None and args.format != "hf":
        raise TesseraError(
            f"--out {args.out} applies to --format hf; the dcp export is always written to "
            f"{args.run}/export/step_N, where `tessera generate {args.run}` reads it: leave --out out, or add "
            "--format hf"
        )
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    if "RANK" not in os.environ:
        # The launcher reads only meta.json (no torch), so a wrong run folder, checkpoint or --nproc is named at
        # once, and only the ranks it starts (or this process, alone) import torch.
        meta = source_checkpoint(Path(args.run), checkpoint)
        sharded = is_sharded(meta)
        if sharded and args.nproc not in (None, meta.get("world_size")):
            raise TesseraError(wrong_world_size(Path(args.run), meta, args.nproc))
        nproc = args.nproc or (meta.get("world_size") if sharded else 1)
        if nproc > 1:
            print(f"exporting {meta['path']} ({meta.get('layout')}) on {nproc} local processes", flush=True)
            return _relaunch_with_torchrun(nproc)
    from tessera.train.export import export_weights

    out = Path(args.out) if args.out else None
    path = export_weights(Path(args.run), checkpoint, args.format, out)
    if path is not None and args.format == "hf":
        print(f"exported a Hugging Face folder to {path}; AutoModelForCausalLM.from_pretrained reads it")
    elif path is not None:
        print(f"exported the plain model's weights to {path}; `tessera generate {args.run}` reads them")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from tessera.train.plot import plot_run  # no torch; it reads and checks the metrics before matplotlib

    out = plot_run(Path(args.run_dir), Path(args.out) if args.out else None)
    print(f"wrote {out}")
    return 0


def cmd_schedule(args: argparse.Namespace) -> int:
    from tessera.sim.render import TEXT_LIMIT, image_note, show_schedule

    limit = None if args.full_text else TEXT_LIMIT
    text = show_schedule(
        args.name, args.pp, args.microbatches, v=args.stages_per_rank, out=args.out, max_text=limit
    )
    print(text)
    if args.out:
        note = image_note(args.pp)  # how a picture of many ranks was fitted (thinner rows)
        print(f"wrote {args.out}" + (f" ({note})" if note else ""))
    return 0


def cmd_memory(args: argparse.Namespace, extra: list[str]) -> int:
    from tessera.memory import estimate
    from tessera.startup import startup_memory

    cfg = _load(args, extra)
    device = args.device_memory * 2**30 if args.device_memory else None
    per_node = None
    if args.hardware:
        from tessera.planner.hardware import load_hardware

        hw = load_hardware(args.hardware)
        device, per_node = hw.memory_bytes, hw.gpus_per_node
    est = estimate(cfg, args.world_size, device)
    print(f"per-rank memory estimate for {args.config or 'the defaults'} at world size {args.world_size}:")
    print(f"  {est.describe()}")
    if cfg.data.document_mask:
        print(f"  {_document_mask_note(cfg, est.plan)}")
    if per_node:  # the hardware's node size is known: where hybrid sharding's shard groups sit (docs/zero.md)
        _print_shard_placement(cfg, args.world_size, per_node)
    start = startup_memory(cfg, args.world_size)
    print(f"  {start.describe()}")
    binds = "start-up" if start.peak > est.total else "training"
    print(
        f"  peak: training {est.total / 2**30:.2f} GiB, start-up {start.peak / 2**30:.2f} GiB; {binds} binds"
    )
    problem = est.explain_overflow(device)
    if problem:
        print(problem)
        return 1
    if device:
        print(f"  fits: {est.total / 2**30:.2f} GiB of {device / 2**30:.2f} GiB")
    return 0


def _document_mask_note(cfg: Config, plan: Plan) -> str:
    """What document masking adds (in the activations above, or in working memory while a fully checkpointed
    block is recomputed): the micro-batch's additive masks, shared by the layers, and RoPE's gathered tables
    per layer."""
    from tessera.planner.cost import ModelShape
    from tessera.planner.cost.rank_memory import (
        attention_bias_bytes,
        mask_kinds,
        rope_position_bytes,
        shared_mask_bytes,
    )

    shape = ModelShape.from_config(cfg.model)
    masks = attention_bias_bytes(shape, plan)
    kept = shared_mask_bytes(shape, plan)
    held = "kept" if kept else f"not kept under {plan.recompute} checkpointing or soft-capped attention"
    rope = rope_position_bytes(shape, plan)
    return (
        f"document masking: {mask_kinds(shape)} [b, 1, s, s] additive mask(s), {masks / 2**20:.1f} MiB per "
        f"micro-batch, shared by the layers ({held}); RoPE at document positions {rope / 2**20:.1f} MiB per "
        "layer (docs/memory.md)"
    )


def _print_shard_placement(cfg: Config, world_size: int, gpus_per_node: int) -> None:
    """A warning line when `parallel.zero_shard_size`'s shard groups straddle nodes of ``gpus_per_node`` GPUs
    (the warning `tessera train` prints from LOCAL_WORLD_SIZE at start-up, `tessera.groups`)."""
    from tessera.execution import resolve

    plan = resolve(cfg, world_size, training=False)
    if plan.zero and plan.zero_replicas > 1:
        message = plan.layout.shard_placement_warning(plan.zero_shard, gpus_per_node)
        if message:
            print(f"  warning: {message}")


def cmd_dryrun(args: argparse.Namespace, extra: list[str]) -> int:
    from tessera.execution import resolve
    from tessera.layout import Layout, parse_ranks

    cfg = _load(args, extra)
    resolve(cfg, args.world_size, training=False)  # as `dry_run` resolves it: no data is read
    layout = Layout.from_config(cfg.parallel, args.world_size)
    try:
        ranks = parse_ranks(args.ranks, layout)
    except ValueError as e:
        raise TesseraError(str(e)) from None
    if args.peak_tensors < 0:
        raise TesseraError(
            f"--peak-tensors {args.peak_tensors}: give how many groups of tensors to list at each rank's peak, "
            "0 or more (0 lists none)"
        )
    # the dry run imports torch (seconds): only once the config and --ranks are known to be right
    from tessera.dryrun import dry_run, estimated_memory, format_peak_tensors, format_rank, formula_traffic

    print(f"dry run of {args.config or 'the defaults'}: {layout.describe()}, ranks {ranks}", flush=True)
    for rank in ranks:
        result = dry_run(cfg, args.world_size, rank, peak_tensors=args.peak_tensors > 0)
        est, traffic = (
            estimated_memory(cfg, args.world_size, rank),
            formula_traffic(cfg, args.world_size, rank),
        )
        print(format_rank(result, est, traffic), flush=True)
        if args.peak_tensors:
            print(format_peak_tensors(result, args.peak_tensors), flush=True)
    return 0


def _side_overrides(extra: list[str]) -> tuple[list[str], list[str]]:
    """compare's overrides: ``--a.section.key=v`` / ``--b.section.key=v`` for one run, plain ones for both."""
    items = _split_overrides(extra)
    a = [x for x in items if not x.startswith(("a.", "b."))]
    b = list(a)
    for x in items:
        side, _, rest = x.partition(".")
        if side in ("a", "b"):
            if "." not in rest.split("=", 1)[0]:
                raise TesseraError(
                    f"override --{x} must look like --{side}.section.key=value, e.g. --b.parallel.zero=3"
                )
            (a if side == "a" else b).append(rest)
    return a, b


def cmd_compare(args: argparse.Namespace, extra: list[str]) -> int:
    """Run two layouts of one training run from the same seed and data; 0 within tolerance, 1 diverged."""
    if args.record is not None:  # a rank of one of the two runs (started by `tessera.parity.run_config`)
        from tessera.parity import record_to_file

        follow = Path(args.follow) if args.follow else None
        return record_to_file(
            Path(args.config_json), args.steps, Path(args.record), args.scale_grad, follow, args.keep_states
        )
    cfg_a, cfg_b, nproc_a, nproc_b = _compare_inputs(args, extra)
    from tessera.parity import compare

    print(f"comparing A ({nproc_a} process(es)) with B ({nproc_b}) for {args.steps} step(s)", flush=True)
    report = compare(cfg_a, cfg_b, nproc_a, nproc_b, args.steps, scale_grad_b=args.scale_grad)
    print(report.table(args.top))
    print(report.verdict())
    return 0 if report.ok else 1


def _compare_inputs(args: argparse.Namespace, extra: list[str]) -> tuple[Config, Config, int, int]:
    """compare's two configs and world sizes, every problem refused before a process starts."""
    from tessera.config import load_config
    from tessera.parity import check_comparable, check_scale_grad, default_nproc

    for side in ("b", "a"):  # argparse takes an override holding a space for a positional config
        value = getattr(args, side)
        if value is not None and value.startswith("--") and "=" in value:
            setattr(args, side, None)
            extra = [value, *extra]
    if args.steps < 1:
        raise TesseraError(f"--steps {args.steps} must be at least 1, e.g. --steps 2")
    over_a, over_b = _side_overrides(extra)
    cfg_a, cfg_b = load_config(args.a, over_a), load_config(args.b or args.a, over_b)  # none: the defaults
    check_comparable(cfg_a, cfg_b)
    nproc_a = default_nproc(cfg_a) if args.nproc_a is None else args.nproc_a
    nproc_b = default_nproc(cfg_b) if args.nproc_b is None else args.nproc_b
    if nproc_a < 1 or nproc_b < 1:
        raise TesseraError(f"--nproc-a {nproc_a} and --nproc-b {nproc_b} must be at least 1")
    for side, cfg, nproc in (("A", cfg_a, nproc_a), ("B", cfg_b, nproc_b)):
        try:
            cfg.validate(nproc)
        except TesseraError as e:
            raise type(e)(f"config {side} at {nproc} process(es): {e}") from None
    check_scale_grad(cfg_b, args.scale_grad)
    return cfg_a, cfg_b, nproc_a, nproc_b


def _parser() -> argparse.ArgumentParser:
    from tessera import __version__
    from tessera.planner.cli import _no_extra  # the one "no overrides here" wrapper, shared with plan

    ap = argparse.ArgumentParser(prog="tessera", description=__doc__)
    ap.add_argument("--version", action="version", version=f"tessera {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model (run under torchrun, or use --nproc on one machine)")
    p.add_argument("config", nargs="?", help="TOML config; overrides follow as --section.key=value")
    p.add_argument("--nproc", type=int, default=1, help="processes to start on this machine (via torchrun)")
    p.add_argument(
        "--max-restarts", type=int, default=0, help="with --nproc: restart all ranks after a failure, N times"
    )
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("validate", help="check a config for a world size; lists every problem")
    p.add_argument("config", nargs="?")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument(
        "--data", action="store_true", help="also verify data.path's checksum and token ids (reads the file)"
    )
    p.set_defaults(fn=cmd_validate)

    p = sub.add_parser(
        "compare",
        help="train two layouts of one run from the same seed and data; compare losses, every gradient, params",
        description="B runs first and is the reference; A starts every step after the first from B's state, so "
        "each step is compared from equal inputs (docs/parity.md). Exit status 0: within the tolerances, 1: "
        "diverged, 2: bad input.",
    )
    p.add_argument(
        "a", nargs="?", help="config A (TOML); overrides: --section.key=v (both), --a.section.key=v"
    )
    p.add_argument("b", nargs="?", help="config B (default: A again, changed by --b.section.key=v overrides)")
    p.add_argument(
        "--nproc-a", type=int, default=None, help="processes of A (default: what its config states)"
    )
    p.add_argument(
        "--nproc-b", type=int, default=None, help="processes of B (default: what its config states)"
    )
    p.add_argument("--steps", type=int, default=2, help="optimizer steps to run and compare")
    p.add_argument("--top", type=int, default=10, help="rows of the worst-tensors table")
    p.add_argument(
        "--scale-grad",
        default=None,
        metavar="NAME=FACTOR",
        help="multiply parameter NAME's gradient in B by FACTOR before each update: a wrong gradient, to see "
        "that compare catches one of that size",
    )
    p.add_argument("--record", default=None, help=argparse.SUPPRESS)  # a rank of one run: where to save it
    p.add_argument("--config-json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--follow", default=None, help=argparse.SUPPRESS)  # the other run's states, per step
    p.add_argument("--keep-states", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(fn=cmd_compare)

    p = sub.add_parser(
        "memory", help="estimate per-rank memory before launch; says what to change if it does not fit"
    )
    p.add_argument("config", nargs="?")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--device-memory", type=float, default=None, help="GiB per device")
    p.add_argument("--hardware", default=None, help="a hardware name (a100-80gb, h100, ...) for its memory")
    p.set_defaults(fn=cmd_memory)

    p = sub.add_parser(
        "dryrun",
        help="build and step chosen ranks of a real-size layout on fake tensors; compare memory and traffic",
    )
    p.add_argument("config", nargs="?")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument(
        "--ranks",
        default=None,
        help="comma-separated ranks (default: first and last pipeline rank of replica 0)",
    )
    p.add_argument(
        "--peak-tensors",
        type=int,
        default=0,
        metavar="N",
        help="also list, per rank, the N largest groups of tensors alive at its peak (shape, dtype, bytes, the "
        "operator, autograd node and code line that made them)",
    )
    p.set_defaults(fn=cmd_dryrun)

    p = sub.add_parser(
        "prepare", help="tokenize text, JSONL, JSON, Parquet or HF dataset folders into a token file"
    )
    p.add_argument(
        "inputs",
        nargs="*",
        help="files (.jsonl, .jsonl.gz, .json, .parquet, anything else is text), directories, or folders "
        "written by datasets' save_to_disk (default: the Python standard library)",
    )
    p.add_argument("--out", required=True, help="token file to write")
    p.add_argument("--tokenizer", default="byte", help='"byte", a tokenizers JSON file, or an HF folder')
    p.add_argument("--text-key", default="text", help="the text field/column of JSON, Parquet and HF inputs")
    p.add_argument(
        "--prompt-key",
        default=None,
        help="fine-tuning records: the prompt field/column (with --completion-key; replaces --text-key); "
        "writes a loss mask (FILE.mask) marking the completions as the only targets",
    )
    p.add_argument("--completion-key", default=None, help="fine-tuning records: the completion field/column")
    p.add_argument(
        "--messages-key",
        default=None,
        help="chat records: the field/column of the conversation (a list of {role, content}); renders it with "
        "the --tokenizer folder's chat template and writes a loss mask (FILE.mask) keeping the assistant turns",
    )
    p.add_argument(
        "--tools-key",
        default=None,
        help="chat records: the field/column of the tools (JSON schemas) passed to the chat template "
        "(default: tools, where a record has it); a named field no record has is a warning (--strict: an error)",
    )
    p.add_argument(
        "--eot-token",
        default=None,
        help="token, or id (a number), ending each document; default: the tokenizer's own (with --messages-key, "
        "when the chat template writes it: a special token named <|endoftext|>, <|end_of_text|>, </s> or <eos> "
        "that the template never writes)",
    )
    p.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: every core)")
    p.add_argument("--strict", action="store_true", help="stop at the first bad record instead of skipping")
    p.add_argument("--default-mb", type=float, default=8.0, help="size of the default corpus, MiB")
    p.set_defaults(fn=_no_extra(cmd_prepare))

    p = sub.add_parser("config", help="every config section and key: type, default and what it means")
    p.add_argument("--markdown", action="store_true", help="as docs/config.md (Markdown tables)")
    p.set_defaults(fn=_no_extra(cmd_config))

    p = sub.add_parser("generate", help="sample text from a run's latest checkpoint")
    p.add_argument("run", help="run directory (holds config.json and checkpoints/)")
    p.add_argument(
        "--prompt", default=None, help='text to continue (default "def "); with --chat, the user\'s turn'
    )
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep tokens up to this mass")
    p.add_argument(
        "--no-kv-cache", action="store_true", help="re-run the model on the whole context per token"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        help="end sampling at this token (its text, one token; repeatable); the output leaves it out",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user turn, rendered with the run's tokenizer folder's chat template; sampling ends at "
        "the template's end of turn and only the reply is printed",
    )
    p.add_argument("--system", default=None, help="with --chat: the system turn, rendered before the rest")
    p.add_argument(
        "--messages",
        default=None,
        metavar="FILE.json",
        help="with --chat: the chat so far, a JSON list of {role, content} messages; --prompt, if given, is "
        "added as the user's next turn, and the reply is the next assistant turn",
    )
    p.add_argument(
        "--tools",
        default=None,
        metavar="FILE.json",
        help="with --chat: the tools the model may call, a JSON list of tool schemas (as chat records' tools "
        "field), given to the chat template",
    )
    p.set_defaults(fn=_no_extra(cmd_generate))

    p = sub.add_parser(
        "export", help="merge a run's sharded checkpoint (tensor/pipeline/ZeRO) into one copy of the weights"
    )
    p.add_argument("run", help="run directory (holds config.json and checkpoints/); writes RUN/export/step_N")
    p.add_argument("--checkpoint", default=None, help="a checkpoint folder (default: the run's newest)")
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local processes (default: 1; a format 1 checkpoint with shards: as many as saved it)",
    )
    p.add_argument(
        "--format",
        choices=("dcp", "hf"),
        default="dcp",
        help="dcp: tessera weights for `generate`; hf: config.json + safetensors for transformers",
    )
    p.add_argument("--out", default=None, help="folder to write (--format hf; default RUN/export/hf_step_N)")
    p.set_defaults(fn=_no_extra(cmd_export))

    p = sub.add_parser("plot", help="draw loss and throughput curves of a run as a PNG")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None)
    p.set_defaults(fn=_no_extra(cmd_plot))

    p = sub.add_parser("schedule", help="pipeline schedules")
    ssub = p.add_subparsers(dest="schedule_command", required=True)
    s = ssub.add_parser("show", help="render a schedule's timeline as text and a picture")
    s.add_argument("name")
    s.add_argument("--pp", type=int, required=True)
    s.add_argument("--microbatches", type=int, required=True)
    s.add_argument("--stages-per-rank", type=int, default=1)
    s.add_argument("--out", default=None, help="PNG or SVG file to write")
    s.add_argument(
        "--full-text",
        action="store_true",
        help="print the text timeline however long (by default one over 1,000,000 characters is not printed)",
    )
    s.set_defaults(fn=_no_extra(cmd_schedule))

    from tessera.planner.cli import add_plan_parsers

    add_plan_parsers(sub)  # plan, calibrate
    return ap


def _lost_peer(e: BaseException) -> str | None:
    """One line for a collective that failed because another rank died (gloo/NCCL), else None."""
    text = str(e)
    markers = ("Connection closed by peer", "Connection reset by peer", "ECONNRESET", "Broken pipe", "NCCL")
    if type(e).__name__ in ("DistBackendError", "DistNetworkError") or any(m in text for m in markers):
        first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
        return f"lost contact with another rank ({first[:120]})"
    return None


def _output_closed() -> int:
    """Stop quietly, as a Unix tool killed by SIGPIPE would (exit 128 + 13): whoever read our output has what it
    wanted. stdout points at /dev/null so that the interpreter's flush at exit does not fail on the pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_OUTPUT_CLOSED


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for a user error, with the message on stderr)."""
    if argv is None:  # the process's own command line, so its interpreter ends with the command
        finish_quickly_at_exit()
    args, extra = _parser().parse_known_args(argv)
    fn: Callable[[argparse.Namespace, list[str]], int] = args.fn
    if argv is None:  # a torchrun worker must not outlive torchrun's agent
        from tessera.train.launch import die_with_torchrun_agent

        die_with_torchrun_agent()
    try:
        return fn(args, extra)
    except TesseraError as e:
        from tessera.rank_errors import report_error

        report_error(e)  # once for all the ranks that say the same (docs/launching.md)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # our own output's reader left (`tessera plan | head`), not another rank
        return _output_closed()
    except Exception as e:
        lost = _lost_peer(e)
        if lost is None:
            raise
        if "TESSERA_LAUNCHER" not in os.environ:  # tessera's launcher names the rank that died
            sys.stderr.write(f"[rank {os.environ.get('RANK', '?')}] stopped: {lost}\n")
        return EXIT_PEER_LOST
