"""What the NVLink kernel tests (test_nvlink_allreduce.py, test_nvlink_gather_scatter.py) share:
the group sizes they run at, the GPU of a rank, the path counters, the subgroup and path-off
groups and the replay data."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _harness import BACKEND

# Every group size the machine has GPUs for (the limits differ by size).
WORLDS = [
    pytest.param(2, id="2gpu"),
    pytest.param(4, id="4gpu", marks=pytest.mark.cuda(world_size=4)),
]


def rank_device(rank: int) -> torch.device:
    """One GPU per rank, made current."""
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def nvlink_calls(key: str, group: Any = None) -> int:
    """How many calls of the group took the NVLink kernel that stats() counts under `key`."""
    import torchext

    return int(torchext.stats(group).get(key, {}).get("count", 0))


def sub_and_off_groups(ws: int) -> tuple[Any, Any]:
    """Two groups over the same `ws` ranks: a subgroup (buffers of its own) and one created with
    FASTCOMM_NVLINK=0 (the NVLink path off)."""
    sub = dist.new_group(list(range(ws)), backend=BACKEND)
    os.environ["FASTCOMM_NVLINK"] = "0"
    try:
        off = dist.new_group(list(range(ws)), backend=BACKEND)
    finally:
        del os.environ["FASTCOMM_NVLINK"]
    return sub, off


def replay_pattern(base: torch.Tensor, rank: int, i: int, dt: torch.dtype) -> torch.Tensor:
    """Small integers (|x| <= 30) that differ by rank and replay: sums of up to 8 ranks and their
    halves are exact in every dtype, so replays are checked for equality."""
    return torch.remainder(base + (13 * rank + i), 61).sub_(30).to(dt)
