"""A user error on many ranks, shown once: which ranks said it, and each different message once.

Two kinds of user error (`tessera.errors.TesseraError`) end a rank:

- **Decisions every rank makes alike** from the same inputs: the command line and the config (`cfg.validate`),
  and a resume refused because a setting differs from the checkpoint's (`tessera.train.compat`). Code that
  makes one marks the error inside `decided_on_every_rank`.
- **Everything else**, which may be one rank's own: a file missing on one node, one rank's shard, an error
  only one pipeline stage meets.

Under tessera's launcher (``tessera train --nproc N``) a rank does not print its error: it writes it to
``TESSERA_ERROR_DIR/rank{r}.json`` (`write_report`), and the launcher, once the ranks have ended, prints each
different message once with the ranks that reported it (`format_reports`: ``[ranks 0-1023] error: ...``). A rank
never waits for another to decide whether to print; the launcher waits (a bounded time) only after an
every-rank decision, for the other ranks to reach it too, and stops them as before otherwise. A rank that
cannot write its report prints it.

The watchdog's hang message (`report_hang`) is one more: every rank blocked in the collective that never
completes times out alike, with messages that differ only in numbers (seconds idle, the last step). Its report
marks those numbers (``{idle}`` in the message, ``numbers`` beside it), and the launcher prints them as the
range over the ranks (``no progress for 6-8s``); it waits for those ranks as for an every-rank decision, except
the ones the message names as not responding (they are frozen and will never report).

Under torchrun (or srun running torchrun) no process sees the other ranks' output, so the same error cannot be
merged after the fact, and a rank must not wait unboundedly on peers that may be dead. The ranks meet in
torchrun's agent store instead (`job_store`: the agent outlives its workers), with bounded waits only:

- an every-rank decision is printed by the first rank to claim its text (an atomic counter per message), so a
  rank whose decision differs (nodes that read different config files) still prints its own; every rank that
  made one then waits, at most `SAME_ERROR_WAIT_S`, until all have, because torchrun kills the whole group as
  soon as one worker exits, which would silence a rank still on its way to a different message;
- a hang is printed by the first rank to time out; the others exit 4 silently, with their stacks on disk.

Without the agent's store (another launcher) an every-rank decision is printed by rank 0 alone and a hang by
each rank, as before; every other error is always printed by each rank with its rank.
docs/launching.md, "Errors from many ranks".
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.errors import TesseraError
from tessera.files import temp_beside

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = [
    "ERROR_DIR",
    "SAME_ERROR_WAIT_S",
    "STORE_TIMEOUT_S",
    "decided_on_every_rank",
    "format_reports",
    "job_store",
    "name_ranks",
    "rank_ranges",
    "read_reports",
    "report_error",
    "report_hang",
    "write_report",
]

ERROR_DIR = "TESSERA_ERROR_DIR"
"""Set by tessera's launcher in every rank's environment: the folder each rank writes its error report to."""

SAME_ERROR_WAIT_S = 10.0
"""After a rank meets an error every rank decides alike (or a hang), how long the others get to reach it too (they
do within moments: the same decision at the same point; a hang within one watchdog interval, at most 5 s): a
bound, in case one is stuck. The launcher waits this long; under torchrun the ranks do, in the agent's store."""

STORE_TIMEOUT_S = 5.0
"""How long a rank on its way out tries to reach torchrun's agent store before printing as if there were none."""

_KEYS = "tessera/errors"  # this module's keys in the agent's store (under the attempt's own prefix)


@contextlib.contextmanager
def decided_on_every_rank() -> Iterator[None]:
    """Mark a `TesseraError` raised inside as a decision every rank makes alike from the same inputs (the
    config, the command line, a checkpoint's recorded settings), so that one rank's message stands for all."""
    try:
        yield
    except TesseraError as e:
        e.same_on_every_rank = True
        raise


def rank_ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``"0-2, 5, 7-8"``."""
    parts: list[str] = []
    ordered = sorted(set(ranks))
    start = prev = ordered[0] if ordered else 0
    for r in [*ordered[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(parts) if ordered else ""


def name_ranks(ranks: Sequence[int]) -> str:
    """``rank 3``, or ``ranks 0-2, 5`` for several (`rank_ranges`)."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"


def report_error(e: TesseraError, environ: Mapping[str, str] | None = None) -> None:
    """Show ``e`` as this process's error (the `tessera` command's handler): plain in one process; in a rank of
    tessera's launcher, as a report the launcher prints; under torchrun/srun, with this rank's number, except
    an every-rank decision, which only rank 0 prints."""
    env = os.environ if environ is None else environ
    world, rank = int(env.get("WORLD_SIZE", "1")), env.get("RANK")
    if world <= 1 or rank is None:
        sys.stderr.write(f"error: {e}\n")
        return
    folder = env.get(ERROR_DIR)
    if folder and write_report(Path(folder), int(rank), str(e), e.same_on_every_rank):
        return  # the launcher prints it, once for all the ranks that report the same
    if not e.same_on_every_rank:
        sys.stderr.write(f"[rank {rank}] error: {e}\n")  # one write, so ranks' lines do not interleave
        return
    store = job_store(env)
    if store is not None:
        _print_decision_once(store, int(rank), world, e)
    elif rank == "0":  # no place to meet: rank 0 speaks for all (a rank that decided otherwise is not heard)
        others = "rank 1 exits" if world == 2 else f"ranks 1-{world - 1} exit"
        sys.stderr.write(
            f"[rank 0] error: {e}\n(every rank decides this alike, from the same command line, config and "
            f"checkpoint: {others} with status {e.exit_code} too, without repeating it)\n"
        )


def _print_decision_once(store: Store, rank: int, world: int, e: TesseraError) -> None:
    """Print ``e`` unless another rank has claimed the same text, then wait (bounded) until every rank has
    decided: each different decision is printed once, and a rank slower to reach its own is not killed by
    torchrun (which stops the group when the first worker exits) before it claims and prints it."""
    digest = hashlib.sha256(str(e).encode()).hexdigest()[:32]
    try:
        first = store.add(f"{_KEYS}/decision/{digest}", 1) == 1  # atomic: exactly one rank gets 1
    except (RuntimeError, OSError):
        first = True  # the store went away: print, so that nothing is lost
    if first:
        sys.stderr.write(
            f"[rank {rank}] error: {e}\n(every rank decides this alike, from the same command line, config and "
            f"checkpoint: the other ranks that decide the same exit with status {e.exit_code} too, without "
            "repeating it; a rank that decides otherwise prints its own)\n"
        )
        sys.stderr.flush()
    with contextlib.suppress(RuntimeError, OSError):  # torch's store errors are RuntimeErrors
        if store.add(f"{_KEYS}/decided", 1) >= world:
            store.set(f"{_KEYS}/all_decided", "1")
            return
        # some rank may never decide (it accepted, or is dead): the wait is bounded. Polled, not store.wait: its
        # timeout logs two C++ warnings per rank; the back-off spares the store's server at 1,024 ranks
        deadline, pause = time.monotonic() + SAME_ERROR_WAIT_S, 0.02
        while not store.check([f"{_KEYS}/all_decided"]) and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(2 * pause, 0.5)


def report_hang(
    rank: int,
    world: int,
    message: str,
    numbers: dict[str, float],
    silent: Sequence[int],
    environ: Mapping[str, str] | None = None,
) -> None:
    """Show the watchdog's hang message once for all the ranks that time out. ``message`` holds ``{name}``
    for each of ``numbers`` (which differ between ranks: seconds idle, the last step); ``silent``: the ranks it
    names as not responding, which will never report. Never waits on a peer: a rank that times out exits at
    once (tessera/train/watchdog.py)."""
    env = os.environ if environ is None else environ
    if world <= 1:
        sys.stderr.write(f"error: {_fill(message, [numbers])}\n")
        return
    folder = env.get(ERROR_DIR)
    extra = {"numbers": numbers, "others_follow": True, "silent": list(silent)}
    if folder and write_report(Path(folder), rank, message, False, extra):
        return  # the launcher prints one line for the ranks that report it, with the range of the numbers
    store = job_store(env)
    if store is not None:
        with contextlib.suppress(RuntimeError, OSError):  # unreachable now: print, so that nothing is lost
            if store.add(f"{_KEYS}/hang", 1) > 1:
                return  # an earlier rank printed the diagnosis; this one's stack is on disk with the others'
        message += " (the first rank to time out; the others that do exit 4 without repeating this)"
    sys.stderr.write(f"[rank {rank}] error: {_fill(message, [numbers])}\n")


def job_store(environ: Mapping[str, str] | None = None) -> Store | None:
    """A client of torchrun's agent store, under this attempt's prefix (`tessera.train.launch.
    torchrun_attempt_store`), or None: not under torchrun, or not reachable within `STORE_TIMEOUT_S`.

    The agent's store, not the process group's: it exists before ``init_process_group`` (a config refused
    before it) and outlives every worker, so a peer that has died takes nothing with it."""
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None  # checked first: torch is not imported for an error that cannot use it
    from tessera.train.launch import torchrun_attempt_store

    try:
        return torchrun_attempt_store(timedelta(seconds=STORE_TIMEOUT_S), env)
    except (RuntimeError, OSError, KeyError, ValueError):  # a DistStoreError is a RuntimeError
        return None


def write_report(
    folder: Path, rank: int, message: str, same_on_every_rank: bool, extra: dict[str, object] | None = None
) -> bool:
    """Write rank ``rank``'s error to ``folder/rank{r}.json`` whole (a temp file renamed over it: a rank killed
    while writing leaves none); False when it cannot be written, and the rank prints it instead. ``extra``:
    a hang's ``numbers``, ``others_follow`` and ``silent`` (`report_hang`)."""
    out = folder / f"rank{rank}.json"
    try:
        fd, tmp = temp_beside(out)
        with os.fdopen(fd, "w") as f:
            json.dump({"message": message, "same_on_every_rank": same_on_every_rank, **(extra or {})}, f)
        os.replace(tmp, out)
    except OSError:
        return False
    return True


def read_reports(folder: Path, nproc: int) -> dict[int, dict]:
    """The reports ranks 0..nproc-1 wrote to ``folder`` (rank -> {"message", "same_on_every_rank"})."""
    found = {}
    for rank in range(nproc):
        try:
            report = json.loads((folder / f"rank{rank}.json").read_text())
        except (OSError, ValueError):
            continue  # this rank wrote none: it succeeded, was stopped, or failed otherwise
        if isinstance(report, dict) and isinstance(report.get("message"), str):
            found[rank] = report
    return found


def format_reports(reports: dict[int, dict]) -> str:
    """Each different message once, after the ranks that reported it, lowest rank first:
    ``[ranks 0-1023] error: ...``; a message's ``{name}`` as the range of the ranks' ``numbers[name]``
    (``no progress for 6-8s``); empty when there are none."""
    by_message: dict[str, list[int]] = {}
    for rank in sorted(reports):
        by_message.setdefault(reports[rank]["message"], []).append(rank)
    return "".join(
        f"[{name_ranks(ranks)}] error: {_fill(message, [reports[r].get('numbers') or {} for r in ranks])}\n"
        for message, ranks in by_message.items()
    )


def _fill(message: str, numbers: Sequence[dict[str, float]]) -> str:
    """``{name}`` in ``message`` as the whole number each rank gave (``7``) or their range (``6-8``)."""
    for name in {name for each in numbers for name in each}:
        values = [round(each[name]) for each in numbers if isinstance(each.get(name), (int, float))]
        if values:
            low, high = min(values), max(values)
            message = message.replace(f"{{{name}}}", str(low) if low == high else f"{low}-{high}")
    return message
