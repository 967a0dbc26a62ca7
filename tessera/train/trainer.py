"""The training loop: config → layout → groups → parallelized model → steps → metrics → checkpoints.

One code path for one process and many: with no torch.distributed environment the run is the single-device
reference; under torchrun the same loop runs any layout. Every rank seeds identically so initial weights
agree without a broadcast, and the data order depends only on (seed, global sample index).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.constants import default_pg_timeout

from tessera import comm
from tessera.config import Config
from tessera.errors import CheckpointError, ConfigError, DataError
from tessera.execution import DIRECT, resolve
from tessera.groups import Groups, build_groups
from tessera.layout import Axis
from tessera.model.build import meta_model
from tessera.model.documents import Batch, document_positions
from tessera.model.init import InitSource, ValueSource, draw_seed
from tessera.model.materialize import declare, materialize
from tessera.parallel.apply import parallelize, shard_specs
from tessera.parallel.context import context_batch
from tessera.rank_errors import decided_on_every_rank
from tessera.train import checkpoint as ckpt
from tessera.train.async_save import AsyncSaves
from tessera.train.checkpoint_files import RANK_LOCAL_FORMAT, set_aside_later
from tessera.train.compat import check_compatible, run_settings
from tessera.train.data import (
    Blend,
    TokenDataset,
    ensure_default_corpus,
    get_batch,
    index_documents,
    long_documents,
    open_data,
    target_count,
)
from tessera.train.health import StepHealth, check_state_finite
from tessera.train.launch import STORE_FD, torchrun_attempt_store
from tessera.train.metrics import MetricsLogger, Progress, memory_bytes, peak_flops_for
from tessera.train.run_files import checkpoint_dir, previous_checkpoint_dir
from tessera.train.runlock import run_dir_lock
from tessera.train.schedule import lr_at
from tessera.train.skips import is_skipped, skipped_before, steps_text
from tessera.train.steppers import make_optimizer, make_stepper
from tessera.train.stopping import StopRequests
from tessera.train.watchdog import Watchdog

__all__ = [
    "StepHook",
    "TrainResult",
    "TrainingRun",
    "checkpoint_dir",
    "init_distributed",
    "lr_at",
    "make_optimizer",
    "train",
]

StepHook = Callable[[int, nn.Module], None]


@dataclass(slots=True)
class TrainResult:
    """What a run produced on this rank: the loss of every step it ran and where it wrote."""

    losses: dict[int, float] = field(default_factory=dict)
    val_losses: dict[int, float] = field(default_factory=dict)
    """Validation loss after each evaluated step (train.eval_every)."""
    run_dir: Path | None = None
    resumed_from: int = 0
    checkpoint_dir: Path | None = None
    stopped_by: str | None = None
    """The signal that stopped the run early (after a checkpoint), or None when it ran to the end."""


def init_distributed(timeout_s: float = 0) -> tuple[int, int]:
    """Join the torchrun/Slurm process group if the environment names one; (rank, world size). A collective
    that waits longer than ``timeout_s`` (0: torch's default, 30 minutes) fails instead of hanging."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return 0, 1
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(seconds=timeout_s) if timeout_s > 0 else None  # None: torch's default per backend
    store = torchrun_attempt_store(timeout or default_pg_timeout)
    if store is None:
        server = _serve_on_launcher_socket(timeout or default_pg_timeout)
        dist.init_process_group(backend, timeout=timeout)
        del server  # the process group's store holds the server from here on
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def _serve_on_launcher_socket(timeout: timedelta) -> dist.TCPStore | None:
    """Rank 0 under ``tessera train --nproc``: the rendezvous store's server, started on the socket the launcher
    has listened on since before any rank started (`tessera.train.launch.rendezvous_socket`); None elsewhere.

    ``init_process_group``'s env:// rendezvous then asks for rank 0's server on MASTER_PORT as a multi-tenant
    one and is given this one (torch keeps one server per port and process), so the rendezvous itself — its wait
    for every rank, its timeout, its errors — is torch's, unchanged; only the socket is the launcher's. Peers
    that arrived first were queued on it instead of refused (docs/launching.md, "Rendezvous")."""
    fd = os.environ.pop(STORE_FD, None)  # popped: a process this rank starts has no such socket
    if fd is None:
        return None
    os.set_inheritable(int(fd), False)
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,  # the rendezvous' own store waits for the ranks, as before
        multi_tenant=True,
        master_listen_fd=int(fd),
        # libuv's server serves on a given socket from torch 2.8 on (its release notes); the other backend always did
        use_libuv=torch.__version__ >= (2, 8),
    )


def resolve_device(name: str) -> torch.device:
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda' but no CUDA device is visible; set train.device = 'cpu'")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _open_data(cfg: Config, rank: int) -> tuple[TokenDataset | Blend, TokenDataset | Blend | None]:
    """(training data, validation data or None): the configured files, or the default corpus."""
    d = cfg.data
    sources = d.sources()
    if not sources:
        cache = Path(os.environ.get("TESSERA_CACHE", Path.home() / ".cache" / "tessera")).expanduser()
        if rank == 0:
            path = ensure_default_corpus(cache, d.default_corpus_mb)
        if dist.is_initialized():
            dist.barrier()
        if rank != 0:
            path = ensure_default_corpus(cache, d.default_corpus_mb)
        sources = [(str(path), 1.0)]
    data, valid = open_data(sources, d.valid_path, d.valid_fraction, d.window_start, write_index=rank == 0)
    if d.window_start == "document" and dist.is_initialized():
        # one writer: rank 0 reads or builds every file's document-start index (and caches it) while the others
        # wait, then they read its cache; a rank that cannot see it (a node-local folder) scans without writing
        if rank == 0:
            index_documents(data, valid)
        dist.barrier()
    return data, valid


class TrainingRun:
    """State of one training run on one rank.

    ``with_data=False``: no data is opened, no checkpoint is resumed and the initial values are about to be
    overwritten (export, the dry run). ``values=False``: the parameters get their storage, with the same
    transient buffers, but no values (`InitSource`'s ``values``): the dry run, on fake tensors, and the export of
    a format 1 checkpoint, which first checks that the checkpoint holds every tensor it then loads
    (tessera/train/export.py). A run that resumes (``checkpoint.resume`` and a checkpoint to resume from, chosen
    here, before the build) is built so too, after the same check, and `resume` must load it before any step.
    """

    def __init__(
        self, cfg: Config, rank: int, world: int, *, with_data: bool = True, values: bool = True
    ) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        # what runs: raises ConfigError listing every violation (of the data too, when it reads data)
        self.plan = resolve(cfg, world, training=with_data)
        self.layout = self.plan.layout
        self.device = resolve_device(cfg.train.device)
        self.groups: Groups | None = (
            build_groups(self.layout, self.device.type, self.plan.zero_shard if self.plan.zero else None)
            if dist.is_initialized()
            else None
        )
        self.dp_rank = self.groups.coord(Axis.DATA) if self.groups else 0
        self.cp_rank = self.groups.coord(Axis.CONTEXT) if self.groups else 0
        # the ranks splitting a global batch's tokens (data × context): losses are summed over them
        self.dp_group = self.groups.batch if self.groups else None
        self.data, self.valid = _open_data(cfg, rank) if with_data else (None, None)  # export: model only
        for data in (self.data, self.valid):
            if data is not None:
                data.check_vocab(cfg.model.vocab_size)
                if cfg.data.document_mask:
                    data.eot  # noqa: B018 (raises DataError now, before any step, if documents cannot be found)
                for part in data.sources if isinstance(data, Blend) else [data]:
                    if cfg.data.loss_mask and not part.has_mask:  # the DataError naming the file and the fix
                        part.target_mask(0, cfg.model.seq_len, 0)
        if self.data is not None and cfg.data.window_start == "document" and rank == 0:
            warning = long_documents(self.data, cfg.model.seq_len, cfg.data.loss_mask)
            if warning:
                sys.stderr.write(f"WARNING: {warning}\n")
        self.run_dir = Path(cfg.log.run_dir)
        self.ckpt_dir = checkpoint_dir(self.run_dir, cfg)
        # the one place resuming is decided: the checkpoint `resume` loads is chosen (verified, its settings
        # checked) before building, because it overwrites every initial value (export and the dry run, which
        # need no data, load their own or none)
        self._resume_from = (
            self._choose_checkpoint() if with_data and cfg.checkpoint.resume else (None, False)
        )
        resuming = self._resume_from[0] is not None
        torch.manual_seed(cfg.train.seed)  # identical on every rank: replicas start equal without a broadcast
        # model.init's folder is not read when a checkpoint overwrites the values: a fine-tuned run outlives its
        # base model. Resuming draws none either (values=False, as export and the dry run), once the
        # checkpoint is known to hold every tensor of the state (below, before anything reads the model)
        with self._value_source(not with_data or resuming, values and not resuming) as source:
            self.model = self._build_model(source)  # allocation ends with the stepper (pipeline, ZeRO)
            self.stepper = make_stepper(self.model, cfg, self.layout, self.groups, self.plan)
        self._unloaded = resuming  # undrawn until `resume` loads: stepping or saving before it is refused
        if resuming:
            self._require_covered(self._resume_from[0])
        self.optimizer = self.stepper.optimizer
        self.n_micro = self.plan.micro_batches
        self.health = StepHealth(cfg.train)
        self.peak_flops = peak_flops_for(self.device, cfg.train.dtype)
        self.watchdog = Watchdog(self.run_dir, rank, world, cfg.train.hang_timeout_s)  # started by train()
        self.saves: AsyncSaves | None = None  # checkpoint.async: set by train() for the loop's duration
        # first global sample of step k is sample_offset + k * global_batch: 0 unless a resume changed the global
        # batch, then it continues at the sample the checkpoint reached (tessera.train.data.batch_indices)
        self.sample_offset = 0

    def _build_model(self, source: ValueSource) -> nn.Module:
        """This rank's model, allocating only what it holds (docs/sharded-init.md).

        The plain model and its tensor-parallel version are built on the meta device; every local parameter
        declares which block of which plain parameter it is and reads it from ``source`` (the per-name seeded
        init, the same values on any layout). For the direct loop everything local is allocated here;
        otherwise the pipeline builder allocates only this rank's stages, and ZeRO only its flat buffers (ZeRO-3:
        only its shards of them).
        """
        plain = meta_model(self.cfg.model)
        self.flops_per_token = plain.flops_per_token()
        # Order: tensor parallelism decides which blocks exist on this rank (parallel/apply.py); the stepper
        # then adds checkpointing, pipeline stages and ZeRO, or plain data-parallel sync.
        with torch.device("meta"):
            model = parallelize(plain, self.layout, self.groups, self.cfg)
        self.specs = shard_specs(model)  # which block of which global tensor: also what checkpoints say
        declare(model, self.specs, source, self.device)
        if self.plan.runner == DIRECT:
            materialize(model)
        return model

    @contextlib.contextmanager
    def _value_source(self, overwritten: bool = False, values: bool = True) -> Iterator[ValueSource]:
        """Where initial values come from: a Hugging Face folder (``model.init``; each rank reads only its
        slices), else the per-name seeded init (``train.seed``, the same values on any layout). When a checkpoint
        will overwrite them, the folder is not read (it need not exist any more); without ``values``, neither."""
        plain = meta_model(self.cfg.model)
        if not self.cfg.model.init or overwritten or not values:
            yield InitSource.for_model(plain, draw_seed(), values=values)
            return
        from tessera.hf.config import init_folder
        from tessera.hf.weights import HFCheckpoint

        with HFCheckpoint(init_folder(self.cfg.model.init), plain) as source:
            yield source

    def _require_covered(self, path: Path) -> None:
        """Refuse (every rank alike, loading nothing) a checkpoint that lacks a tensor of this rank's state: built
        without values, it would keep undrawn memory. A layout-free checkpoint is read by global names at any
        layout, so the plain model's are checked; a format 1 checkpoint, only at its own layout (refused first,
        as the load would), loads this rank's own slice. A checkpoint the load cannot take at all is refused here
        as the load would refuse it (`checkpoint.loadable_format`)."""
        fmt = ckpt.loadable_format(path, ckpt.checkpoint_meta(path), self.world, self.layout.describe())
        model, shard_id = meta_model(self.cfg.model), None
        if fmt == RANK_LOCAL_FORMAT:
            model, shard_id = self.stepper.state_module, self.stepper.shard_id
        ckpt.require_model_state(path, model, shard_id, "this run's config", "resume", "nothing was loaded")

    def _require_loaded(self) -> None:
        if self._unloaded:
            raise RuntimeError(
                "this run was built without initial values for the checkpoint it resumes from; call resume() "
                "before stepping or saving it"
            )

    @property
    def saved_bytes(self) -> int:
        return self.stepper.saved_bytes

    def batches(self, step: int, data: TokenDataset | Blend | None = None) -> list[Batch]:
        """This data-parallel rank's micro-batches of ``step`` of ``data`` (default: the training data): a pure
        function of (seed, global sample index). With data.document_mask each also carries its tokens'
        positions within their documents (`tessera.model.documents`). The validation data's batch k is always
        its samples [k·B, (k+1)·B): only training continues at ``sample_offset``."""
        cfg, tr = self.cfg, self.cfg.train
        seed = cfg.data.seed if cfg.data.seed is not None else tr.seed
        offset = self.sample_offset if data is None else 0
        data = data if data is not None else self.data
        eot = data.eot if cfg.data.document_mask else None
        masked = cfg.data.loss_mask
        out: list[Batch] = []
        for micro in range(self.n_micro):
            x, y = get_batch(
                data,
                step,
                micro,
                self.dp_rank,
                self.layout.dp,
                tr.micro_batch,
                tr.global_batch,
                cfg.model.seq_len,
                seed,
                offset,
                loss_mask=masked,
            )
            x, y = x.to(self.device), y.to(self.device)
            batch = (x, y) if eot is None else (x, y, document_positions(x, eot))
            if self.layout.cp > 1:  # this context rank's 2 chunks, positions from the whole window
                batch = context_batch(batch, self.layout.cp, self.cp_rank)
            out.append(batch)
        return out

    def target_tokens(self, step: int, data: TokenDataset | Blend | None = None) -> int | None:
        """With data.loss_mask: how many targets the mask keeps in the whole global batch ``step`` of ``data``
        (default: the training data), every rank's every micro-batch, read from the data on each rank alike
        (`target_count`); None without a loss mask (and in the dry run, which has no data)."""
        cfg = self.cfg
        if not cfg.data.loss_mask or (data is None and self.data is None):
            return None
        seed = cfg.data.seed if cfg.data.seed is not None else cfg.train.seed
        offset = self.sample_offset if data is None else 0
        data = data if data is not None else self.data
        return target_count(data, step, cfg.train.global_batch, cfg.model.seq_len, seed, offset)

    def loss_weight(self, targets: int | None) -> float | None:
        """What a masked micro-batch's summed loss is multiplied by: dp·cp / the global batch's target count, so
        the sum over micro-batches, averaged over the data × context ranks (as gradients are), is the global
        batch's loss per target, whatever number of targets each context rank's chunks hold. None (each micro-batch's mean / m, as ever) without a loss mask."""
        if targets is None:
            return None
        if targets == 0:
            raise DataError(
                "a global batch holds no target tokens (every sample is prompt only), so its loss per target is "
                "undefined; the trainer skips such steps (see docs/data.md, Fine-tuning: loss masks)"
            )
        return self.layout.batch_ranks / targets

    def step(self, step: int, hook: StepHook | None, targets: int | None = None) -> tuple[float, float]:
        """One optimizer step: accumulate micro-batches, synchronise, clip, update; returns (loss, grad norm).
        ``targets``: `target_tokens` of the step when the caller has it (counted here otherwise)."""
        tr = self.cfg.train
        self._require_loaded()
        weight = self.loss_weight(targets if targets is not None else self.target_tokens(step))
        total = torch.tensor(self.stepper.run(self.batches(step), weight), device=self.device)
        comm.all_reduce(total, self.dp_group)
        if hook is not None:
            hook(step, self.model)
        norm = self.stepper.clip(tr.grad_clip if tr.grad_clip > 0 else float("inf"))
        loss = total.item() / self.layout.batch_ranks  # the step's one host sync (with the norm's), as before
        # equal on every rank, so every rank decides alike; skips fp16 overflows and, by policy, NaN/inf
        if self.health.apply_update(step, loss, norm, self.stepper.skip_step, self.stepper.state_module):
            for g in self.optimizer.param_groups:
                g["lr"] = lr_at(step, tr)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, norm

    def evaluate(self) -> float:
        """Mean loss over the first ``train.eval_batches`` global batches of the validation data (the same ones
        every time), forward only: parameters, gradients, optimizer state and every RNG are left as they were."""
        if self.valid is None:
            raise ConfigError("train.eval_every needs data.valid_path or data.valid_fraction")
        total = 0.0
        devices = [self.device] if self.device.type == "cuda" else []
        n = self.cfg.train.eval_batches
        # a loss mask: every batch's targets summed, over all of them counted once (token-weighted, as a step)
        targets = self._eval_targets()
        weight = self.loss_weight(targets)
        with torch.random.fork_rng(devices=devices):
            for k in range(n):
                value = self.stepper.evaluate(self.batches(k, self.valid), weight)
                loss = torch.tensor(value, device=self.device)
                comm.all_reduce(loss, self.dp_group)
                total += loss.item() / self.layout.batch_ranks
        return total if weight is not None else total / n

    def _eval_targets(self) -> int | None:
        """The targets a loss mask keeps in all the evaluated batches; None without a mask. DataError if none."""
        if not self.cfg.data.loss_mask:
            return None
        assert self.valid is not None
        n = self.cfg.train.eval_batches
        targets = sum(self.target_tokens(k, self.valid) or 0 for k in range(n))
        if targets == 0:
            raise DataError(
                f"the validation data's first train.eval_batches = {n} global batches hold no target tokens "
                "(every sample is prompt only), so a validation loss per target is undefined; evaluate on "
                "more batches (train.eval_batches) or other validation data"
            )
        return targets

    def save(self, step: int) -> None:
        with self.watchdog.paused():  # a save may take longer than the hang timeout
            self._save(step)

    def finish_saves(self) -> None:
        """Wait until a checkpoint being written in the background is committed (checkpoint.async); raises
        what stopped it."""
        if self.saves is not None:
            with self.watchdog.paused():
                self.saves.wait()

    @contextlib.contextmanager
    def saving_in_background(self) -> Iterator[None]:
        """Within: with checkpoint.async, saves are written and committed in a thread (tessera/train/async_save.py).
        Creating its process group is collective. Leaving on an error still lets an earlier save commit."""
        if not self.cfg.checkpoint.async_:
            yield
            return
        self.saves = AsyncSaves.new(self.cfg.train.collective_timeout_s)
        try:
            yield
            self.finish_saves()
        except BaseException:
            with self.watchdog.paused():
                self.saves.settle()
            raise
        finally:
            self.saves = None

    def _save(self, step: int) -> None:
        self._require_loaded()
        state = self.stepper.rank_state(self.model, self.specs)  # first: ZeRO's gathers in flight finish
        check_state_finite(self.stepper.state_module, step)
        samples = self.sample_offset + step * self.cfg.train.global_batch  # trained on before this step
        extra = {
            "step": step,
            "samples": samples,
            "settings": self.settings,
            "health": self.health.state_dict(),
        }
        scaler = self.stepper.scaler
        if scaler is not None:
            extra["loss_scale"] = scaler.state_dict()
        ckpt.save_checkpoint(
            self.ckpt_dir,
            step,
            self.stepper.state_module,
            self.optimizer,
            extra,
            keep=self.cfg.checkpoint.keep,
            layout=self.layout.describe(),
            background=self.saves,
            state=state,
        )

    def resume(self) -> int:
        """Load the checkpoint chosen when the run was built (the newest that verifies, or ``checkpoint.load_step``'s,
        if resuming is on); the step to start from. Damaged or incomplete newer checkpoints were reported on
        stderr then, never skipped silently."""
        path, verified = self._resume_from  # chosen before the build, which it overwrites
        if path is None:
            return 0
        # the config's hyper-parameters (weight decay, betas, eps) as the optimizer was built with them: the load
        # puts the checkpoint's back where the groups match, which silently undid a changed train.weight_decay
        configured = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        extra = ckpt.load_checkpoint(
            path,
            self.stepper.state_module,
            self.optimizer,
            shard_id=self.stepper.shard_id,  # read only by a format 1 checkpoint (its own layout)
            layout=self.layout.describe(),
            verify=not verified,
            state=self.stepper.rank_state(self.model, self.specs),
        )
        self._unloaded = False
        # they take effect from the resume step (the lr is set from the step anyway)
        for group, settings in zip(self.optimizer.param_groups, configured, strict=True):
            group.update(settings)
        if extra["rng"] is not None:
            ckpt.restore_rng(extra)
        else:  # saved at another layout: its streams are other ranks' (docs/checkpoints.md)
            ckpt.reseed_rng(self.cfg.train.seed, int(extra["step"]), self.rank)
        scaler = self.stepper.scaler
        if scaler is not None and "loss_scale" in extra:
            scaler.load_state_dict(extra["loss_scale"])
        self.health.load_state_dict(extra.get("health") or {})
        step = int(extra["step"])
        self._continue_samples(step, extra.get("samples"))
        return step

    def _continue_samples(self, step: int, samples: int | None) -> None:
        """Continue the data at the sample the checkpoint reached: with the same global batch that is step ·
        global_batch; a changed one would otherwise draw samples [step · new, ...), training again the ones
        before the checkpoint's (smaller batch) or leaving some out (larger). As Megatron-LM's consumed_samples."""
        if samples is None:  # written before checkpoints recorded it: the global batch cannot be compared
            return
        self.sample_offset = int(samples) - step * self.cfg.train.global_batch
        if self.sample_offset and self.rank == 0:
            sys.stderr.write(
                f"NOTE: train.global_batch = {self.cfg.train.global_batch} differs from the checkpoint's; the run "
                f"continues at sample {samples}, where step {step} of the checkpoint's run left off\n"
            )

    def supersede_later(self, start: int) -> None:
        """Set aside the checkpoints of steps after ``start``, which this run replaces (`set_aside_later`).
        Collective: every rank has chosen its checkpoint before rank 0 moves any."""
        if dist.is_initialized():
            dist.barrier()
        if self.rank != 0:
            return
        aside = set_aside_later(self.ckpt_dir, start, time.strftime("%Y%m%d-%H%M%S"))
        if aside is not None:
            sys.stderr.write(
                f"NOTE: this run starts at step {start}, so the checkpoints of later steps belong to the run it "
                f"replaces; moved them to {aside}, where no resume takes them (delete it when not needed)\n"
            )

    def _choose_checkpoint(self) -> tuple[Path | None, bool]:
        """(the checkpoint to resume from, whether its checksums were just verified)."""
        complete, incomplete = ckpt.list_checkpoints(self.ckpt_dir)
        wanted = self.cfg.checkpoint.load_step
        if wanted is not None:
            chosen = [p for p in complete if p.name == ckpt.step_dir_name(wanted)]
            if not chosen:
                raise CheckpointError(
                    f"checkpoint.load_step = {wanted}: {self.ckpt_dir} has no complete checkpoint of that step"
                    f"\n    fix: use one of {[int(p.name.split('_')[1]) for p in complete] or 'none (start fresh)'}"
                )
            self._check_settings(chosen[0])
            return chosen[0], False  # load_checkpoint verifies it and refuses it if damaged: no fallback
        skipped = [f"{p.name} (incomplete: no meta.json marked complete)" for p in incomplete]
        for path in reversed(complete):
            problems = ckpt.verify_checkpoint(path)
            if not problems:
                self._announce(skipped, path)
                self._check_settings(path)
                return path, True
            skipped.append(f"{path.name} (damaged: {'; '.join(problems[:3])})")
        if complete:
            raise CheckpointError(
                f"no checkpoint in {self.ckpt_dir} verifies against its checksums: {'; '.join(skipped)}\n    fix: "
                "restore one from a copy, or start fresh (checkpoint.resume = false, or a new checkpoint.dir)"
            )
        self._refuse_moved_checkpoints()
        self._announce(skipped, None)
        return None, False

    def _refuse_moved_checkpoints(self) -> None:
        """Refuse to start over when the run directory's last run saved its checkpoints in another folder that
        holds some: a changed checkpoint.dir whose checkpoints were not moved along started the run again at
        step 0 and replaced its metrics, without a word."""
        before = previous_checkpoint_dir(self.run_dir)
        if before is None or before.resolve() == self.ckpt_dir.resolve():
            return
        saved = ckpt.list_checkpoints(before)[0]
        if saved:
            raise CheckpointError(
                f"checkpoint.dir {self.ckpt_dir} holds no checkpoint, but the last run in {self.run_dir} saved "
                f"its checkpoints in {before} (newest {saved[-1].name}): resuming would start over at step 0 and "
                f"replace its metrics\n    fix: set checkpoint.dir = {str(before)!r} (or move its step folders "
                "into the new one) to resume, or checkpoint.resume = false to start over"
            )

    def _check_settings(self, path: Path) -> None:
        meta = ckpt.checkpoint_meta(path)
        saved = meta.get("extra") or {}
        opt_in = self.cfg.checkpoint
        # every rank reads the same checkpoint's settings and compares them with the same config
        with decided_on_every_rank():
            check_compatible(
                path,
                saved.get("settings"),
                self.settings,
                int(meta.get("step", 0)),
                new_schedule=opt_in.new_schedule,
                new_data_order=opt_in.new_data_order,
            )

    @property
    def settings(self) -> dict[str, Any]:
        """The settings a checkpoint of this run records and a resume may not change (tessera/train/compat.py):
        the model's, the tokenizer's, the data order's seed, the held-out split's and the lr schedule's."""
        meta = getattr(self.data, "meta", None) or {}  # a blend of token files has no single metadata
        tokens = {k: meta[k] for k in ("tokenizer", "vocab_size") if k in meta}
        if self.data is not None:
            tokens["vocab_size"] = self.data.vocab_size
        d = self.cfg.data
        valid_file = _identity(self.valid) if d.valid_path and isinstance(self.valid, TokenDataset) else None
        held_out = None
        if d.valid_fraction > 0 and self.data is not None:
            files = self.data.sources if isinstance(self.data, Blend) else [self.data]
            weights = [w for _, w in d.sources()] or [1.0]  # the default corpus: one file
            held_out = [(_identity(f), w) for f, w in zip(files, weights, strict=True)]
        return run_settings(self.cfg, tokens, valid_file=valid_file, held_out_files=held_out)

    def _announce(self, skipped: list[str], chosen: Path | None) -> None:
        newer = [s for s in skipped if chosen is None or s.split(" ")[0] > chosen.name]
        if newer and self.rank == 0:
            then = f"resuming from {chosen.name}" if chosen else "starting from step 0"
            sys.stderr.write(f"WARNING: skipping checkpoint(s) {', '.join(newer)}; {then}\n")


def _identity(data: TokenDataset) -> str | None:
    """A token file by its tokens (the start of their sha256, as `prepare` recorded it), not by its path: a copy
    elsewhere is the same data."""
    sha = data.meta.get("sha256")
    return sha[:16] if isinstance(sha, str) else None


def train(cfg: Config, hook: StepHook | None = None) -> TrainResult:
    """Run training as configured; ``hook(step, model)`` sees the synchronised gradients before each update.

    SIGTERM, SIGINT and ``train.stop_signal`` stop every rank at the same step boundary after a checkpoint
    (``result.stopped_by`` names the signal; tessera/train/stopping.py).
    """
    with StopRequests(cfg.train.stop_signal) as stops:
        rank, world = init_distributed(cfg.train.collective_timeout_s)
        with run_dir_lock(Path(cfg.log.run_dir), enabled=rank == 0):  # one run per run directory
            run = TrainingRun(cfg, rank, world)
            result = TrainResult(run_dir=run.run_dir, checkpoint_dir=run.ckpt_dir)
            start = result.resumed_from = run.resume()
            run.supersede_later(start)
            if rank == 0:
                _record_config(run.run_dir, cfg, start)
                _announce_skips(run, start)
            wandb = {"project": cfg.log.wandb_project, "mode": cfg.log.wandb_mode, "config": cfg.to_dict()}
            logger = MetricsLogger(
                run.run_dir, rank, cfg.log.tensorboard, start=start, wandb=wandb if cfg.log.wandb else None
            )
            try:
                with run.watchdog, run.saving_in_background():  # a signal's stop waits for the last save too
                    _loop(run, start, hook, logger, stops, result)
            finally:
                logger.close()
                run.stepper.close()
    return result


def _record_config(run_dir: Path, cfg: Config, start: int) -> None:
    """config.json is the config now running; config_history.jsonl has one line per start (resumes too)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    entry = {"time": time.strftime("%Y-%m-%d %H:%M:%S %z"), "resumed_from": start, "config": cfg.to_dict()}
    with open(run_dir / "config_history.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def _loop(
    run: TrainingRun,
    start: int,
    hook: StepHook | None,
    logger: MetricsLogger,
    stops: StopRequests,
    result: TrainResult,
) -> None:
    cfg = run.cfg
    with Progress(cfg.train.steps, enabled=cfg.log.progress and run.rank == 0) as progress:
        if start:
            progress.resumed(start)
        for step in range(start, cfg.train.steps):
            comm.STATS.reset()
            t0 = time.perf_counter()
            if is_skipped(step, cfg.train.skip_steps):  # train.skip_steps: no forward, backward or update
                metrics = {
                    "step": step,
                    "lr": lr_at(step, cfg.train),
                    "skipped_samples": cfg.train.global_batch,
                }
            elif (targets := run.target_tokens(step)) == 0:  # a loss mask and an all-prompt global batch
                metrics = _no_target_step(run, step)
            else:
                loss, norm = run.step(step, hook, targets)
                result.losses[step] = loss
                metrics = _metrics(run, step, loss, norm, time.perf_counter() - t0)
                if targets is not None:
                    metrics["target_tokens"] = targets
            run.watchdog.progress(step)
            every = cfg.train.eval_every
            if every and ((step + 1) % every == 0 or step + 1 == cfg.train.steps):
                metrics["val_loss"] = result.val_losses[step] = run.evaluate()
                metrics["val_ppl"] = math.exp(min(metrics["val_loss"], 700.0))  # exp overflows past ~709
            # every skipped step has its record
            shown = "val_loss" in metrics or "skipped_samples" in metrics or metrics.get("target_tokens") == 0
            if step % cfg.log.every == 0 or step == cfg.train.steps - 1 or shown:
                logger.log(metrics)
            progress.update(step + 1, metrics)
            done = step + 1
            if done == cfg.train.steps:
                run.save(done)
                return
            saved = bool(cfg.checkpoint.every and done % cfg.checkpoint.every == 0)
            if saved:
                run.save(done)
            result.stopped_by = stops.agreed(run.device)  # every rank, every step: they stop at one step
            if result.stopped_by:
                if not saved:
                    run.save(done)  # resuming loses no step
                return


def _announce_skips(run: TrainingRun, start: int) -> None:
    """Say on stderr which steps from ``start`` on train.skip_steps passes over, and their samples, so that a run
    resumed to step past a loss spike shows that the key took effect (each such step also logs a record with
    ``skipped_samples``)."""
    tr = run.cfg.train
    ahead = [r for r in skipped_before(tr.skip_steps, tr.steps) if r[1] >= start]
    if not ahead:
        return
    ahead[0][0] = max(ahead[0][0], start)  # a run resumed inside a range skips only its rest
    samples = ", ".join(
        f"{run.sample_offset + s * tr.global_batch}-{run.sample_offset + (e + 1) * tr.global_batch - 1}"
        for s, e in ahead
    )
    one = len(ahead) == 1 and ahead[0][0] == ahead[0][1]
    what = f"step {steps_text(ahead)} is" if one else f"steps {steps_text(ahead)} are"
    sys.stderr.write(
        f"NOTE: train.skip_steps: {what} not trained on: {'its' if one else 'their'} samples {samples} are passed "
        "over with no update, and the learning rate schedule moves on as if they had run\n"
    )


def _no_target_step(run: TrainingRun, step: int) -> dict[str, float]:
    """A step whose global batch has no target (data.loss_mask, every sample all prompt): its loss per target is
    0/0, so it is skipped as train.skip_steps skips (no forward, backward or update; the schedule moves on), as
    every rank decides alike from the data. Said on stderr; the record has ``target_tokens`` 0 and no loss."""
    if run.rank == 0:
        sys.stderr.write(
            f"NOTE: data.loss_mask: step {step}'s global batch holds no target token (every sample is prompt "
            "only): skipped with no update\n"
        )
    return {"step": step, "lr": lr_at(step, run.cfg.train), "target_tokens": 0}


def _metrics(run: TrainingRun, step: int, loss: float, norm: float, dt: float) -> dict[str, float]:
    cfg = run.cfg
    tps = cfg.train.global_batch * cfg.model.seq_len / dt
    metrics = {
        "step": step,
        "loss": loss,
        "lr": lr_at(step, cfg.train),
        "grad_norm": norm,
        "tokens_per_s": tps,
        "step_time": dt,
        "saved_activation_bytes": run.saved_bytes,
        "mem_bytes": memory_bytes(run.device),
        **comm.STATS.as_metrics(),
    }
    scaler = run.stepper.scaler
    if scaler is not None:
        metrics["loss_scale"], metrics["skipped_steps"] = scaler.scale, scaler.skipped
    if run.health.skipped:
        metrics["nonfinite_skipped"] = run.health.skipped
    if run.peak_flops:
        metrics["mfu"] = tps * run.flops_per_token / (run.peak_flops * run.world)
    return metrics
