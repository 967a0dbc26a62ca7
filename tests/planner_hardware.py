"""A small hardware description with two network levels, shared by the planner's unit tests: 8 GPUs per node,
NVLink 100 GB/s and 1 µs per hop, a NIC share of 10 GB/s and 10 µs per hop, round numbers for hand checks."""

from __future__ import annotations

from tessera.planner.hardware import Hardware

LEVELS = Hardware(
    name="levels",
    peak_flops={"bf16": 100e12},
    memory_bytes=80e9,
    hbm_bandwidth=1e12,
    gpus_per_node=8,
    intra_node_bandwidth=100e9,
    intra_node_latency=1e-6,
    inter_node_bandwidth=10e9,
    inter_node_latency=1e-5,
)

TWO_CPUS = Hardware(
    name="two-cpus",
    peak_flops={"fp32": 5e10, "bf16": 5e10},
    memory_bytes=4e9,
    hbm_bandwidth=2e10,
    gpus_per_node=2,
    intra_node_bandwidth=2e9,
    intra_node_latency=2e-5,
    inter_node_bandwidth=2e9,
    inter_node_latency=2e-5,
)
"""Two CPU processes as the planner sees them (round figures of a laptop's gloo run, not a calibration): for
`tessera plan --out` files that `tessera train --nproc 2` then runs."""
