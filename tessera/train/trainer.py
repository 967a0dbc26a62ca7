"""The training loop: config → layout → groups → parallelized model → steps → metrics → checkpoints.

One code path for one process and many: with no torch.distributed environment the run is the single-device
reference; under torchrun the same loop runs any layout. Every rank seeds identically so initial weights
agree without a broadcast, and the data order depends only on (seed, global sample index).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tessera import comm
from tessera.config import Config, TrainConfig
from tessera.errors import ConfigError
from tessera.execution import resolve
from tessera.groups import Groups, build_groups
from tessera.layout import Axis
from tessera.model.build import build_model
from tessera.parallel.apply import parallelize
from tessera.train import checkpoint as ckpt
from tessera.train.data import Blend, TokenDataset, ensure_default_corpus, get_batch, open_data
from tessera.train.metrics import MetricsLogger, Progress, memory_bytes, peak_flops_for
from tessera.train.steppers import make_optimizer, make_stepper

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


def init_distributed() -> tuple[int, int]:
    """Join the torchrun/Slurm process group if the environment names one; (rank, world size)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return 0, 1
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def resolve_device(name: str) -> torch.device:
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda' but no CUDA device is visible; set train.device = 'cpu'")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def lr_at(step: int, tr: TrainConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at ``steps``."""
    if step < tr.warmup_steps:
        return tr.lr * (step + 1) / tr.warmup_steps
    progress = (step - tr.warmup_steps) / max(1, tr.steps - tr.warmup_steps)
    return tr.min_lr + 0.5 * (tr.lr - tr.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


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
    return open_data(sources, d.valid_path, d.valid_fraction)


def checkpoint_dir(run_dir: Path, cfg: Config) -> Path:
    """Where a run's training checkpoints go: ``checkpoint.dir``, or RUN_DIR/checkpoints."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(run_dir) / "checkpoints"


class TrainingRun:
    """State of one training run on one rank."""

    def __init__(self, cfg: Config, rank: int, world: int, *, with_data: bool = True) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        self.plan = resolve(cfg, world)  # what runs: raises ConfigError listing every violation
        self.layout = self.plan.layout
        self.device = resolve_device(cfg.train.device)
        self.groups: Groups | None = (
            build_groups(self.layout, self.device.type) if dist.is_initialized() else None
        )
        self.dp_rank = self.groups.coord(Axis.DATA) if self.groups else 0
        self.dp_group = self.groups.dp if self.groups else None
        self.data, self.valid = _open_data(cfg, rank) if with_data else (None, None)  # export: model only
        for data in (self.data, self.valid):
            if data is not None:
                data.check_vocab(cfg.model.vocab_size)
        torch.manual_seed(cfg.train.seed)  # identical on every rank: replicas start equal without a broadcast
        plain = build_model(cfg.model).to(self.device)
        if cfg.model.init:
            # TEMPORARY until construction is per-parameter: every rank fills the whole plain model from the
            # HF folder (reading all of it) before parallelize cuts its shard. With sharded construction the
            # same `HFCheckpoint` is the value source and each rank reads only its slices.
            from tessera.hf.weights import load_init

            load_init(plain, cfg.model.init)
        self.flops_per_token = plain.flops_per_token()
        # Order: tensor parallelism cuts this rank's shards from the identical full model (parallel/apply.py);
        # the stepper then adds checkpointing, pipeline stages and ZeRO, or plain data-parallel sync.
        self.model = parallelize(plain, self.layout, self.groups, cfg)
        self.stepper = make_stepper(self.model, cfg, self.layout, self.groups, self.plan)
        self.optimizer = self.stepper.optimizer
        self.n_micro = self.plan.micro_batches
        self.run_dir = Path(cfg.log.run_dir)
        self.ckpt_dir = checkpoint_dir(self.run_dir, cfg)

    @property
    def saved_bytes(self) -> int:
        return self.stepper.saved_bytes

    def batches(
        self, step: int, data: TokenDataset | Blend | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This data-parallel rank's micro-batches of ``step`` of ``data`` (default: the training data): a pure
        function of (seed, global sample index)."""
        cfg, tr = self.cfg, self.cfg.train
        seed = cfg.data.seed if cfg.data.seed is not None else tr.seed
        out = []
        for micro in range(self.n_micro):
            x, y = get_batch(
                data if data is not None else self.data,
                step,
                micro,
                self.dp_rank,
                self.layout.dp,
                tr.micro_batch,
                tr.global_batch,
                cfg.model.seq_len,
                seed,
            )
            out.append((x.to(self.device), y.to(self.device)))
        return out

    def step(self, step: int, hook: StepHook | None) -> tuple[float, float]:
        """One optimizer step: accumulate micro-batches, synchronise, clip, update; returns (loss, grad norm)."""
        tr = self.cfg.train
        total = torch.tensor(self.stepper.run(self.batches(step)), device=self.device)
        comm.all_reduce(total, self.dp_group)
        if hook is not None:
            hook(step, self.model)
        norm = self.stepper.clip(tr.grad_clip if tr.grad_clip > 0 else float("inf"))
        for g in self.optimizer.param_groups:
            g["lr"] = lr_at(step, tr)
        if not self.stepper.skip_step:  # fp16 overflow: skip this update on every rank
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total.item() / self.layout.dp, norm

    def evaluate(self) -> float:
        """Mean loss over the first ``train.eval_batches`` global batches of the validation data (the same ones
        every time), forward only: parameters, gradients, optimizer state and every RNG are left as they were."""
        if self.valid is None:
            raise ConfigError("train.eval_every needs data.valid_path or data.valid_fraction")
        total = 0.0
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            for k in range(self.cfg.train.eval_batches):
                loss = torch.tensor(self.stepper.evaluate(self.batches(k, self.valid)), device=self.device)
                comm.all_reduce(loss, self.dp_group)
                total += loss.item() / self.layout.dp
        return total / self.cfg.train.eval_batches

    def save(self, step: int) -> None:
        extra = {"step": step, "samples": step * self.cfg.train.global_batch}
        scaler = getattr(self.stepper, "scaler", None)
        if scaler is not None:
            extra["loss_scale"] = scaler.state_dict()
        ckpt.save_checkpoint(
            self.ckpt_dir,
            step,
            self.stepper.state_module,
            self.optimizer,
            extra,
            keep=self.cfg.checkpoint.keep,
            shard_id=self.stepper.shard_id,
            layout=self.layout.describe(),
        )

    def resume(self) -> int:
        """Load the latest complete checkpoint if resuming is on; the step to start from."""
        if not self.cfg.checkpoint.resume:
            return 0
        path = ckpt.latest_checkpoint(self.ckpt_dir)
        if path is None:
            return 0
        extra = ckpt.load_checkpoint(
            path,
            self.stepper.state_module,
            self.optimizer,
            shard_id=self.stepper.shard_id,
            layout=self.layout.describe(),
        )
        ckpt.restore_rng(extra)
        scaler = getattr(self.stepper, "scaler", None)
        if scaler is not None and "loss_scale" in extra:
            scaler.load_state_dict(extra["loss_scale"])
        return int(extra["step"])


def train(cfg: Config, hook: StepHook | None = None) -> TrainResult:
    """Run training as configured; ``hook(step, model)`` sees the synchronised gradients before each update."""
    rank, world = init_distributed()
    run = TrainingRun(cfg, rank, world)
    result = TrainResult(run_dir=run.run_dir)
    start = result.resumed_from = run.resume()
    if rank == 0:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        (run.run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    wandb = {"project": cfg.log.wandb_project, "mode": cfg.log.wandb_mode, "config": cfg.to_dict()}
    logger = MetricsLogger(
        run.run_dir, rank, cfg.log.tensorboard, start=start, wandb=wandb if cfg.log.wandb else None
    )
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    peak = peak_flops_for(run.device, cfg.train.dtype)
    with Progress(cfg.train.steps, enabled=cfg.log.progress and rank == 0) as progress:
        if start:
            progress.resumed(start)
        for step in range(start, cfg.train.steps):
            comm.STATS.reset()
            t0 = time.perf_counter()
            loss, norm = run.step(step, hook)
            dt = time.perf_counter() - t0
            result.losses[step] = loss
            tps = tokens_per_step / dt
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
            scaler = getattr(run.stepper, "scaler", None)
            if scaler is not None:
                metrics["loss_scale"], metrics["skipped_steps"] = scaler.scale, scaler.skipped
            if peak:
                metrics["mfu"] = tps * run.flops_per_token / (peak * world)
            every = cfg.train.eval_every
            if every and ((step + 1) % every == 0 or step + 1 == cfg.train.steps):
                metrics["val_loss"] = result.val_losses[step] = run.evaluate()
                metrics["val_ppl"] = math.exp(min(metrics["val_loss"], 700.0))  # exp overflows past ~709
            if step % cfg.log.every == 0 or step == cfg.train.steps - 1 or "val_loss" in metrics:
                logger.log(metrics)
            progress.update(step + 1, metrics)
            done = step + 1
            if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == cfg.train.steps:
                run.save(done)
    logger.close()
    run.stepper.close()
    return result
