"""`tessera plan` and `tessera calibrate`: argument parsers and command functions.

`tessera.cli` calls `add_plan_parsers(subparsers)`; each command is registered with
``set_defaults(fn=...)`` taking ``(args, extra)`` like the other subcommands.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessera.errors import ConfigError, TesseraError

if TYPE_CHECKING:
    from tessera.planner.hardware import Hardware
    from tessera.planner.run_settings import RunInputs

__all__ = ["add_plan_parsers", "cmd_calibrate", "cmd_plan"]


def _model_arg(text: str) -> tuple[Any, bool, dict[str, Any]]:
    """A planner model name, or a TOML config file whose [model] section is used; whether the config trains
    with data.document_mask (whose attention masks, one per micro-batch, the memory estimate counts); and the
    file's tables as written (`plan --out` keeps its data, train, checkpoint and log keys)."""
    if text.endswith(".toml") or Path(text).is_file():
        import tomllib

        from tessera.config import load_config

        cfg = load_config(text)  # refuses a missing, unreadable or invalid file with the reason
        return cfg.model, cfg.data.document_mask, tomllib.loads(Path(text).read_text(encoding="utf-8"))
    return text, False, {}


def _run_inputs(args: argparse.Namespace, file: dict[str, Any]) -> RunInputs:
    """The run's settings the user chose (`run_settings.RunInputs`): the flags and the model's config file."""
    from tessera.planner.run_settings import RunInputs

    return RunInputs(
        data=args.data,
        valid=args.valid,
        steps=args.steps,
        tokens=args.tokens,
        run_dir=args.run_dir,
        file=file,
        file_name=args.model if file else None,
    )


def _hardware(args: argparse.Namespace) -> Hardware:
    """The hardware file, with --storage-gbps (GB/s per GPU) in place of its storage_write_bandwidth."""
    from dataclasses import replace

    from tessera.planner.hardware import load_hardware
    from tessera.planner.stacks import with_stack

    hw = load_hardware(args.hardware)
    try:
        hw = with_stack(hw, args.stack)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return hw if args.storage_gbps is None else replace(hw, storage_write_bandwidth=args.storage_gbps * 1e9)


def cmd_plan(args: argparse.Namespace) -> int:
    """Search layouts, print the top ones with breakdowns and reasons; optionally write JSON/TOML/PNG."""
    from tessera.planner.report import explain, render_picture, render_text, to_json, write_config
    from tessera.planner.search import SearchSpace, default_jobs, search
    from tessera.planner.stacks import DEFAULT_STACK

    if args.global_batch is not None and args.critical_batch:
        raise ConfigError("give either --global-batch N or --critical-batch, not both")
    _check_run_flags(args)
    if args.stack != DEFAULT_STACK and args.out is not None:
        raise ConfigError(
            f"--out writes a run tessera executes, and tessera runs the {DEFAULT_STACK} stack: drop --stack "
            f"{args.stack} (it prices the layouts at that stack's compute rate, a comparison) or --out"
        )
    hw = _hardware(args)
    if args.stack != DEFAULT_STACK and not args.json:
        print(
            f"stack {args.stack}: compute priced at framework share {hw.gemm_framework_share:g} "
            f"(tessera itself runs the {DEFAULT_STACK} stack; docs/planner.md, 'Software stacks')"
        )
    model, document_mask, file = _model_arg(args.model)
    space = SearchSpace(
        dtype=args.dtype,
        flash_attention=not args.no_flash_attention,
        document_mask=document_mask,
        uneven_pipelines=args.uneven_pipelines,
    )
    if document_mask and not args.json:
        print(
            "document masking (data.document_mask): each micro-batch's [b, 1, s, s] attention mask is counted"
        )
    try:
        result = search(
            model,
            args.gpus,
            hw,
            args.global_batch,
            space=space,
            target_loss=args.target_loss,
            jobs=args.jobs or default_jobs(),
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not result.candidates:
        raise ConfigError(result.no_fit_message())
    entries = explain(result, args.top)
    print(to_json(result, entries) if args.json else render_text(result, entries))
    best = entries[0].candidate
    if args.out:
        write_config(result, best, args.out, _run_inputs(args, file))
        if not args.json:
            print(f"\nwrote {args.out} (check: tessera validate {args.out} --world-size {args.gpus})")
            _print_data_notes(args.out, args.gpus)
    if args.picture:
        render_picture(result, entries, args.picture)
        if not args.json:
            print(f"wrote {args.picture}")
    return 0


RUN_FLAGS = ("data", "valid", "steps", "tokens", "run_dir", "storage_gbps")
"""The flags that shape the file --out writes (`run_settings.RunInputs`)."""


def _check_run_flags(args: argparse.Namespace) -> None:
    given = [f"--{name.replace('_', '-')}" for name in RUN_FLAGS if getattr(args, name) is not None]
    if given and not args.out:
        raise ConfigError(f"{', '.join(given)} set what `--out FILE` writes: add --out plan.toml")


def _print_data_notes(path: str, gpus: int) -> None:
    """Say what is wrong with the data the written config names, or that it names none."""
    from tessera.config import load_config
    from tessera.planner.report import data_problems

    if load_config(path).data.path is None:
        print("note: no --data: the config trains on tessera's embedded demo corpus; pass --data PATH")
    for problem in data_problems(path, gpus):
        print(f"note: here, {problem}")


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure this machine and write a hardware TOML usable with `tessera plan --hardware FILE`: the CPU
    (`calibrate`) or, with --device cuda (auto when CUDA is available), this GPU node (`calibrate_gpu`)."""
    import torch

    from tessera.planner.calibrate import calibrate, calibrate_gpu, resolve_device
    from tessera.planner.hardware import save_hardware

    available = torch.cuda.is_available()
    detail = f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}"
    device = resolve_device(args.device, available, detail)
    if device == "cpu" and args.base is not None:
        raise TesseraError(
            f"--base {args.base} applies to a GPU calibration (--device cuda); a CPU profile is measured whole"
        )
    name = args.name or Path(args.out).stem
    try:
        if device == "cuda":
            hw, report = calibrate_gpu(name, args.base, quick=args.quick, world=args.processes)
        else:
            hw, report = calibrate(
                name=name, quick=args.quick, world=2 if args.processes is None else args.processes
            )
    except (RuntimeError, TimeoutError) as e:  # a measurement or a collective process failed or hung
        raise TesseraError(f"calibration failed: {e}") from None
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_hardware(hw, args.out)
    print(report)
    print(f"wrote {args.out}")
    return 0


def _no_extra(fn):
    def run(args: argparse.Namespace, extra: list[str]) -> int:
        if extra:
            raise TesseraError(f"unrecognised arguments {extra}")
        return fn(args)

    return run


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 2e12)") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive, finite number")
    return value


def add_plan_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register `plan` and `calibrate` on the `tessera` subcommand parser."""
    p = subparsers.add_parser("plan", help="search parallel layouts for a model and GPU count")
    p.add_argument("--model", required=True, help="model name (e.g. llama-70b, megatron-1t) or a config TOML")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--hardware", default="a100-80gb", help="shipped hardware name or a TOML file")
    p.add_argument(
        "--stack",
        default="default",  # stacks.DEFAULT_STACK, imported lazily: this parser is built for every command
        help="software stack whose compute rate prices the layouts: default (what tessera runs) or megatron-te "
        "(Megatron-Core + Transformer Engine, calibrated for h100; tessera.planner.stacks)",
    )
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=int, default=None, help="sequences per step")
    batch.add_argument(
        "--critical-batch",
        action="store_true",
        help="use Kaplan's critical batch (the default without a batch)",
    )
    p.add_argument(
        "--target-loss", type=float, default=None, help="loss target for the critical batch (nats)"
    )
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--out", default=None, help="write the best layout as a runnable tessera config TOML")
    run = p.add_argument_group("the run --out writes (docs/planner.md, 'What plan --out writes')")
    run.add_argument("--data", default=None, help="token file for data.path (`tessera prepare`)")
    run.add_argument(
        "--valid", default=None, help="validation token file (data.valid_path); sets train.eval_every"
    )
    length = run.add_mutually_exclusive_group()
    length.add_argument("--steps", type=_positive_int, default=None, help="train.steps")
    length.add_argument(
        "--tokens",
        type=_positive_number,
        default=None,
        help="training tokens, e.g. 2e12: steps = ceil(tokens / batch tokens)",
    )
    run.add_argument(
        "--run-dir",
        default=None,
        help="log.run_dir (default runs/MODEL-Ngpu); checkpoints in DIR/checkpoints",
    )
    run.add_argument(
        "--storage-gbps",
        type=_positive_number,
        default=None,
        help="checkpoint write bandwidth per GPU in GB/s (default: the hardware file's storage_write_bandwidth)",
    )
    p.add_argument("--picture", default=None, help="write a PNG of the step-time breakdowns")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--no-flash-attention", action="store_true", help="count the s×s attention scores")
    p.add_argument(
        "--uneven-pipelines",
        action="store_true",
        default=None,
        help="also try pipeline sizes that do not divide the layers (balanced uneven stage_layers); without "
        "it they are tried only when no layout whose pipeline size divides the layers fits",
    )
    p.add_argument(
        "--jobs",
        type=_positive_int,
        default=None,
        help="processes that price the layouts (default: this machine's cores, at most 8); the answer is the same "
        "for any number",
    )
    p.set_defaults(fn=_no_extra(cmd_plan))

    c = subparsers.add_parser("calibrate", help="measure this machine into a hardware TOML")
    c.add_argument("--out", required=True, help="hardware TOML to write, e.g. hardware/this-cpu.toml")
    c.add_argument("--name", default=None)
    c.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="what to measure: this CPU, or this GPU node (auto: cuda when torch sees a CUDA device)",
    )
    c.add_argument(
        "--base",
        default=None,
        help="cuda: the hardware file whose published fields (peak, network, fitted shares) are kept, a shipped "
        "name (h100, a100-80gb, ...) or a TOML path; default: chosen from the device name",
    )
    c.add_argument(
        "--processes",
        type=int,
        default=None,
        help="collective sweep: gloo processes on cpu (default 2), GPUs of this node on cuda (default all)",
    )
    c.add_argument("--quick", action="store_true", help="fewer sizes and repeats (a few seconds)")
    c.set_defaults(fn=_no_extra(cmd_calibrate))
