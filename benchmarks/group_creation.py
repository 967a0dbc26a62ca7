"""What creating hybrid sharding's process groups costs one rank at large world sizes, without GPUs.

    python benchmarks/group_creation.py                    # worlds 1024, 4096, 16384; writes the results file
    python benchmarks/group_creation.py --worlds 1024      # one world, printed only

Each measurement is a fresh process that joins torch's "fake" process group (`tessera.fake`) as rank 0 of a world
of W ranks, a pure data-parallel layout (d = W) with hybrid sharding over s = 8 (one 8-GPU node: W/8 shard groups of
8, 8 replica groups of W/8), and times, wall and process seconds, each phase of `tessera.groups.build_groups`:

- ``mesh``: `init_device_mesh` of the layout's axes (data W × pipe 1 × tensor 1, size-1 axes included);
- ``members``: `Layout.data_shard_groups` + `data_replica_groups`, the member lists;
- ``shard`` / ``replica``: `_subgroup` (`dist.new_subgroups_by_enumeration`: every rank calls `new_group` for
  every group, W/8 + 8 calls);

and the alternative of making the shard and replica groups mesh dimensions, as torchtitan does
(``dp_replicate`` × ``dp_shard``, flattened back into the data axis; `ParallelDims.build_mesh`):
``mesh 2-D``, `init_device_mesh` of (W/8, 8, 1, 1) with ``_flatten`` of the two data dimensions.

What the fake backend does not show: NCCL communicator set-up, which only the groups holding the rank pay (one
per dimension either way); and `split_group`, which `init_device_mesh` uses instead of `new_group` per subgroup
only when the default group is bound to a device (`init_process_group(device_id=...)`, NCCL): tessera does not
bind one, so on GPUs too the mesh route enumerates every subgroup, as here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "group_creation.md"
SHARD = 8
WORLDS = (1024, 4096, 16384)
PHASES = ("mesh", "members", "shard", "replica", "mesh 2-D")

MEMBERS_BEFORE = (
    "## The member lists before\n\n"
    "Until this benchmark's commit `Layout.all_groups` listed every rank's `group_members` (world × group size "
    "steps): `data_shard_groups(8)` + `data_replica_groups(8)` of a pure data-parallel layout took 26.5 s at W = "
    "1,024 and 105.9 s at W = 2,048 (1.6 s at 256, 6.2 s at 512: ×4 per doubling), on every rank at start-up; now "
    '0.07 s and 0.14 s. Measured at 4cfbbec, load average 0.1: `python -c "import time; from tessera.layout import '
    "Layout; L = Layout(dp=W); t = time.perf_counter(); L.data_shard_groups(8); L.data_replica_groups(8); "
    'print(time.perf_counter() - t)"`.\n'
)
"""The member lists' cost before `Layout.all_groups` became one pass (measured once; the old code is gone)."""

_CHILD = r"""
import json, sys, time
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from tessera.fake import fake_process_group
from tessera.groups import _subgroup
from tessera.layout import Layout

world, shard, route = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
layout = Layout(dp=world)
out = {}

def timed(name, fn):
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn()
    out[name] = (time.perf_counter() - wall, time.process_time() - cpu)
    return value

with fake_process_group(0, world):
    names = tuple(a.value for a in layout.axes)
    if route == "subgroups":  # what build_groups does
        timed("mesh", lambda: init_device_mesh("cpu", layout.shape, mesh_dim_names=names))
        shards, replicas = timed(
            "members", lambda: (layout.data_shard_groups(shard), layout.data_replica_groups(shard))
        )
        timed("shard", lambda: _subgroup(shards, "data_shard"))
        timed("replica", lambda: _subgroup(replicas, "data_replicate"))
    else:  # torchtitan's: the data axis as replicate x shard mesh dimensions, flattened back into "data"
        def mesh_2d():
            shape = (world // shard, shard, *layout.shape[1:])
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("data_replicate", "data_shard", *names[1:]))
            mesh["data_replicate", "data_shard"]._flatten("data")
            return mesh

        timed("mesh 2-D", mesh_2d)
print(json.dumps(out))
"""


def measure(world: int, route: str) -> dict[str, tuple[float, float]]:
    """One fresh process: the phases of ``route`` ("subgroups" or "mesh") as rank 0 of ``world``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(world), str(SHARD), route],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return {k: tuple(v) for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def table(rows: dict[int, dict[str, tuple[float, float]]]) -> str:
    head = "| world W | " + " | ".join(PHASES) + " | groups created (`new_group` calls, subgroups route) |"
    lines = [head, "|" + "---|" * (len(PHASES) + 2)]
    for world, phases in rows.items():
        cells = [f"{phases[p][0]:.2f} ({phases[p][1]:.2f})" if p in phases else "–" for p in PHASES]
        calls = f"{2 * world} (mesh: W per size-1 axis) + {world // SHARD} + {SHARD}"
        lines.append(f"| {world} | " + " | ".join(cells) + f" | {calls} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    args = parser.parse_args()
    rows: dict[int, dict[str, tuple[float, float]]] = {}
    for world in args.worlds:
        rows[world] = {**measure(world, "subgroups"), **measure(world, "mesh")}
        print(world, {k: round(v[0], 3) for k, v in rows[world].items()}, flush=True)
    text = table(rows)
    print(text)
    if args.worlds == list(WORLDS):
        load = os.getloadavg()[0]
        RESULTS.write_text(
            "# Hybrid sharding's group creation at large world sizes\n\n"
            f"`python benchmarks/group_creation.py` ({time.strftime('%Y-%m-%d')}, load average {load:.1f} on a "
            "shared 2-core machine). Rank 0 of a fake process group of W ranks (`tessera.fake`), d = W, shard "
            f"size s = {SHARD}; seconds wall (process) per phase of `tessera.groups.build_groups`, and the "
            "torchtitan-style alternative (shard and replica as mesh dimensions, flattened into data) in "
            '`mesh 2-D`. Fresh process per route. What it means: docs/zero.md, "Group creation at scale".\n\n'
            + text
            + "\n\n"
            + MEMBERS_BEFORE
        )
        print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
