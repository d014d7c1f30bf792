#!/usr/bin/env python3
"""Runs a command pinned to this local rank's slice of the CPUs.

Meant as the script of a torchrun launch:

    python -m torch.distributed.run --nproc_per_node=4 scripts/pin_local_rank.py \\
        python3 benchmarks/bench_collectives.py ...

LOCAL_RANK and LOCAL_WORLD_SIZE (set by torchrun) split the CPUs this process
may run on into equal slices of whole physical cores (a core's SMT siblings
stay together, so two ranks never share a core); local rank r takes slice r,
then execs the command, whose threads (fastcomm's proxy and progress threads,
NCCL's, CUDA's) inherit the mask. It is a probe: scripts/device_check.sh
`spread` compares pinned launches with free ones to learn whether thread
placement is what makes some launches of the multi-node all_reduce slow.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def core_of(cpu: int) -> tuple[int, int]:
    """(package, core) of a logical CPU; the CPU itself where sysfs says nothing."""
    topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text())
    except (OSError, ValueError):
        return (-1, cpu)


def slice_for(local_rank: int, local_world: int, cpus: set[int]) -> list[int]:
    """The logical CPUs of local rank `local_rank`'s share of the physical cores in `cpus`."""
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} is outside 0..{local_world - 1}")
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(cpus):
        cores.setdefault(core_of(cpu), []).append(cpu)
    order = sorted(cores, key=lambda core: cores[core][0])
    lo = local_rank * len(order) // local_world
    hi = (local_rank + 1) * len(order) // local_world
    mine = [cpu for core in order[lo:hi] for cpu in cores[core]]
    # More ranks than cores: share them all rather than leave a rank none.
    return mine or sorted(cpus)


def compact(cpus: list[int]) -> str:
    """1,2,3,7 -> '1-3,7'."""
    runs: list[str] = []
    start = prev = None
    for cpu in sorted(cpus):
        if start is None:
            start = prev = cpu
        elif cpu == prev + 1:
            prev = cpu
        else:
            runs.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = cpu
    if start is not None:
        runs.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(runs)


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: pin_local_rank.py COMMAND [ARGS...]  (under torchrun)")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cpus = slice_for(local_rank, local_world, os.sched_getaffinity(0))
    os.sched_setaffinity(0, cpus)
    print(
        f"# pin_local_rank: local rank {local_rank} of {local_world} on CPUs {compact(cpus)}",
        file=sys.stderr,
        flush=True,
    )
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
