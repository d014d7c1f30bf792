"""FASTCOMM_CPU_AFFINITY=local (csrc/common/affinity.*): the C++ slice of the cores agrees with
the probe script's (scripts/pin_local_rank.py) on made-up and on this host's topologies, and in a
2-node group fastcomm's own threads (fc-*) run on their local rank's slice while the application's
main thread keeps its mask; without the setting nothing is pinned."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from _harness import is_gloo, load_script, run_ranks

pytestmark = pytest.mark.skipif(is_gloo(), reason="fastcomm's own threads")


@pytest.mark.parametrize(
    "ncores,smt,world", [(32, 2, 4), (8, 2, 3), (6, 1, 4), (2, 2, 4), (5, 4, 2), (1, 1, 1)]
)
def test_slice_matches_the_probe_script(monkeypatch, ncores: int, smt: int, world: int) -> None:
    from torchext import _C

    pin = load_script("pin_local_rank")
    # Siblings one core-count apart, as Linux numbers them; two packages when there are
    # enough cores, to check that (package, core) and not core alone tells cores apart.
    packages = 2 if ncores >= 4 else 1

    per_package = -(-ncores // packages)

    def core_of(cpu: int) -> tuple[int, int]:
        core = cpu % ncores
        return (core // per_package, core % per_package)

    monkeypatch.setattr(pin, "core_of", core_of)
    cpus = list(range(ncores * smt))
    cores = {cpu: core_of(cpu) for cpu in cpus}
    slices = []
    for r in range(world):
        mine = _C._affinity_slice(cpus, r, world, cores)
        assert mine == sorted(pin.slice_for(r, world, set(cpus))), (r, mine)
        slices.append(mine)
    if ncores >= world:
        assert sorted(c for s in slices for c in s) == cpus  # disjoint and complete
        for s in slices:
            assert len(s) == smt * len({cores[c] for c in s})  # whole cores


def test_slice_on_this_host_matches_the_probe_script() -> None:
    from torchext import _C

    pin = load_script("pin_local_rank")
    allowed = sorted(os.sched_getaffinity(0))
    for world in (1, 2, 3, 4):
        for r in range(world):
            got = _C._affinity_slice(allowed, r, world)
            assert got == sorted(pin.slice_for(r, world, set(allowed))), (world, r, got)


def test_bad_local_rank_is_refused() -> None:
    from torchext import _C

    with pytest.raises(ValueError, match="outside"):
        _C._affinity_slice([0, 1], 2, 2)


def _masks() -> dict[str, set[int]]:
    """name -> allowed CPUs of this process's threads (the main thread under 'main')."""
    out: dict[str, set[int]] = {}
    pid = os.getpid()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
        cpus: set[int] = set()
        for part in line.split(":", 1)[1].strip().split(","):
            lo, _, hi = part.partition("-")
            cpus |= set(range(int(lo), int(hi or lo) + 1))
        out["main" if int(tid) == pid else f"{name}#{tid}"] = cpus
    return out


def affinity_fn(rank: int, ws: int) -> dict[str, Any]:
    allowed = sorted(os.sched_getaffinity(0))
    t = torch.arange(1 << 16, dtype=torch.float32) + rank
    dist.all_reduce(t)  # across the 2 nodes: the tcp transport's threads start
    expected = sum(range(ws)) + ws * torch.arange(1 << 16, dtype=torch.float32)
    assert torch.equal(t, expected)
    masks = {k: sorted(v) for k, v in _masks().items()}
    return {
        "allowed": allowed,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "local_world": int(os.environ["LOCAL_WORLD_SIZE"]),
        "masks": masks,
    }


@pytest.mark.parametrize("setting", ["local", "none"])
def test_fastcomm_threads_run_on_their_slice(setting: str) -> None:
    pin = load_script("pin_local_rank")
    env = lambda rank: {  # noqa: E731
        "FASTCOMM_HOST_ID": f"simnode{rank}",
        "FASTCOMM_CPU_AFFINITY": setting,
        "FASTCOMM_TCP_THREADS": "2",
    }
    for rank, r in enumerate(run_ranks(2, affinity_fn, env=env, timeout_s=120)):
        allowed = set(r["allowed"])
        want = (
            set(pin.slice_for(r["local_rank"], r["local_world"], allowed))
            if setting == "local"
            else allowed
        )
        ours = {k: set(v) for k, v in r["masks"].items() if k.startswith("fc-")}
        names = {k.split("#")[0] for k in ours}
        assert {"fc-tcp0", "fc-tcp1", "fc-host"} <= names, (rank, sorted(r["masks"]))
        for name, cpus in ours.items():
            assert cpus == want, (rank, name, sorted(cpus), sorted(want))
        assert set(r["masks"]["main"]) == allowed, (rank, r["masks"]["main"])
