"""Backend registration, torchext.stats(), profiler events.

Tests marked "fastcomm package" need the installed fastcomm distribution and are skipped
when FASTCOMM_TEST_BACKEND names another backend; the rest run against any backend.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist

from _harness import BACKEND, Checker, gen, run_ranks

needs_fastcomm = pytest.mark.skipif(
    BACKEND != "fastcomm", reason=f"fastcomm package test (backend under test: {BACKEND})"
)


def _all_reduce_check(chk: Checker, key: str) -> None:
    ws, rank = dist.get_world_size(), dist.get_rank()
    ins = [gen(key, r, (10,), torch.float32, "SUM") for r in range(ws)]
    t = ins[rank].clone()
    dist.all_reduce(t)
    chk.reduced(t, ins, "SUM", key)


@needs_fastcomm
def test_entry_point_declared() -> None:
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="torch.distributed.backends")}
    assert eps.get("fastcomm") == "torchext._registration:register", eps


def init_without_import_fn(rank: int, ws: int) -> dict[str, Any]:
    chk = Checker(f"rank {rank}")
    chk.true("torchext" not in sys.modules, "torchext was imported before init_process_group")
    dist.init_process_group(backend=BACKEND)
    chk.true(dist.get_backend() == BACKEND, f"get_backend() = {dist.get_backend()!r}")
    _all_reduce_check(chk, "no-import")
    dist.barrier()
    if BACKEND == "fastcomm":  # the entry point loaded the package on demand
        chk.true("torchext" in sys.modules, "torchext not loaded by the entry point")
    dist.destroy_process_group()
    chk.raise_if_failed()
    return {"backend": BACKEND}


@pytest.mark.parametrize("ws", [1, 2])
def test_init_without_import(ws: int) -> None:
    """init_process_group(backend=...) in a fresh process that never imported torchext
    (fastcomm: found through the torch.distributed.backends entry point)."""
    run_ranks(ws, init_without_import_fn, init=False, import_torchext=False, timeout_s=120)


def import_and_stats_fn(rank: int, ws: int) -> dict[str, Any]:
    import torchext

    chk = Checker(f"rank {rank}")
    chk.true(dist.get_backend() == "fastcomm", f"get_backend() = {dist.get_backend()!r}")
    chk.true(dist.is_backend_available("fastcomm"), "is_backend_available('fastcomm') is False")
    _all_reduce_check(chk, "warm-up")
    s0 = torchext.stats()
    chk.true(isinstance(s0, dict), f"stats() returned {type(s0)}")
    before = s0.get("all_reduce", {}).get("count", 0)
    bytes_before = s0.get("all_reduce", {}).get("bytes", 0)
    for i in range(3):
        _all_reduce_check(chk, f"counted {i}")  # 10 float32 each
    s1 = torchext.stats()
    entry = s1.get("all_reduce")
    chk.true(isinstance(entry, dict), f"stats() has no 'all_reduce' entry: {s1}")
    if isinstance(entry, dict):
        for k in ("count", "bytes", "time_us"):
            chk.true(k in entry, f"stats()['all_reduce'] lacks {k!r}: {entry}")
        chk.true(
            entry.get("count") == before + 3,
            f"all_reduce count went {before} -> {entry.get('count')} after 3 all_reduces",
        )
        chk.true(
            entry.get("bytes", 0) >= bytes_before + 3 * 40,
            f"all_reduce bytes went {bytes_before} -> {entry.get('bytes')} (+120 expected)",
        )
    torchext.reset_stats()
    s2 = torchext.stats()
    chk.true(
        s2.get("all_reduce", {"count": 0}).get("count", 0) == 0,
        f"reset_stats() did not zero the all_reduce count: {s2}",
    )
    chk.raise_if_failed()
    return {"before": s1.get("all_reduce"), "after_reset": s2.get("all_reduce")}


@needs_fastcomm
def test_import_torchext_and_stats() -> None:
    """With `import torchext`: the backend works, get_backend() is "fastcomm", stats()
    counts all_reduce calls and reset_stats() zeroes them. All ranks claim the same host
    through FASTCOMM_HOST_ID (single node)."""
    run_ranks(
        2,
        import_and_stats_fn,
        import_torchext=True,
        env={"FASTCOMM_HOST_ID": "same-host"},
        timeout_s=120,
    )


def profiler_fn(rank: int, ws: int) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    chk = Checker(f"rank {rank}")
    _all_reduce_check(chk, "warm-up")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _all_reduce_check(chk, "profiled")
    names = sorted({e.name for e in prof.events()})
    want = f"{BACKEND}:all_reduce"
    chk.true(any(want in n for n in names), f"no profiler event containing {want!r}: {names}")
    chk.raise_if_failed()
    return [n for n in names if BACKEND in n]


def test_profiler_event() -> None:
    """An all_reduce under torch.profiler.profile() records an event named
    "<backend>:all_reduce" (fastcomm:all_reduce)."""
    run_ranks(2, profiler_fn, timeout_s=120)


@needs_fastcomm
def test_the_shipped_module_exposes_no_test_only_name() -> None:
    """torchext._C (what `pip install .` installs) carries only the product: the
    bindings tests use live in torchext._testing, which links against it."""
    import torchext._C as core

    public = {"ProcessGroupFastComm", "has_cuda", "nccl_version"}
    private_product = {"_timeline", "_dump_trace"}  # torchext.timeline()'s, dump_trace()'s sources
    names = {n for n in dir(core) if not n.startswith("__")}
    assert public <= names, public - names
    unexpected = names - public - private_product
    assert not unexpected, f"torchext._C exposes names outside the product: {sorted(unexpected)}"
