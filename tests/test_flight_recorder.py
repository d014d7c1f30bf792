"""The flight recorder (csrc/backend/flight_recorder.hpp) and its analyser
(torchext/trace_analysis.py).

- One group of 2 ranks: the ring keeps the last FASTCOMM_TRACE_BUFFER_SIZE ops of each group
  with their fields; torchext.dump_trace() and FASTCOMM_TRACE_SIGNAL write dumps; a group created
  with the recorder off is in none.
- One group of 3 ranks, three scripted hangs, each in a fresh fastcomm group with a short
  timeout: (a) rank 1 skips an all_reduce; (b) rank 1 calls it with another shape; (c) rank 1 is
  stuck in a gloo collective (a peer library) while the others call fastcomm's. The ranks
  that time out raise the group's timeout error and dump, every other rank dumps at their
  request, and the analyser names rank 1 and the collective.
- On 2 GPUs, (c) with rank 1 inside an NCCL group's all_reduce.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from _harness import BACKEND, run_ranks

pytestmark = pytest.mark.skipif(BACKEND != "fastcomm", reason="fastcomm's own recorder")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "fastcomm_trace_rank_"


def _load(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        return pickle.load(f)


def _wait_for_dump(path: str, since_ns: int, timeout_s: float) -> dict[str, Any] | None:
    """The dump at ``path`` written after ``since_ns``, waiting for it up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(path):
            dump = _load(path)
            if dump["time_ns"] > since_ns:
                return dump
        time.sleep(0.1)
    return None


def _with_env(env: dict[str, str], make: Any) -> Any:
    """``make()`` with ``env`` set: the recorder's settings are read when a group is created."""
    with mock.patch.dict(os.environ, env):
        return make()


# ------------------------------------------------------------------- ring, fields, dumps


def ring_fn(rank: int, ws: int, outdir: str) -> dict[str, Any]:
    import torchext

    dist.init_process_group(backend="fastcomm", timeout=timedelta(seconds=60))
    sub = dist.new_group([0, 1])
    off = _with_env({"FASTCOMM_TRACE_BUFFER_SIZE": "0"}, lambda: dist.new_group([0, 1]))
    x = torch.ones(2, 3)
    for _ in range(10):  # world seq 1..10
        dist.all_reduce(x)
    dist.broadcast(torch.zeros(5, dtype=torch.float64), src=1)  # seq 11
    t = torch.arange(3.0)
    if rank == 0:  # p2p seq 1
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
    outs = [torch.zeros(4, dtype=torch.int32) for _ in range(ws)]
    dist.all_gather(outs, torch.full((4,), rank, dtype=torch.int32))  # seq 12
    dist.reduce_scatter_tensor(
        torch.zeros(2, dtype=torch.bfloat16),
        torch.ones(4, dtype=torch.bfloat16),
        op=dist.ReduceOp.MAX,
    )  # seq 13
    dist.barrier()  # seq 14
    dist.all_reduce(torch.ones(7), op=dist.ReduceOp.MAX, group=sub)
    dist.all_reduce(torch.ones(7), group=off)

    out: dict[str, Any] = {"sub_name": sub.group_name}
    out["default_path"] = torchext.dump_trace()
    out["on_demand"] = _load(out["default_path"])
    custom = os.path.join(outdir, "custom", f"mine{rank}")
    out["custom_path"] = torchext.dump_trace(custom)
    t0 = time.time_ns()
    os.kill(os.getpid(), signal.SIGUSR1)
    signalled = _wait_for_dump(out["default_path"], t0, 20)
    out["signal_reason"] = None if signalled is None else signalled["dump_reason"]
    dist.destroy_process_group()
    try:  # no group records any more
        torchext.dump_trace(os.path.join(outdir, "none"))
        out["no_group_raises"] = False
    except RuntimeError:
        out["no_group_raises"] = True
    return out


def test_ring_fields_and_dumps(tmp_path: Any) -> None:
    outdir = str(tmp_path)
    env = {
        "FASTCOMM_TRACE_BUFFER_SIZE": "8",
        "FASTCOMM_TRACE_FILE": os.path.join(outdir, PREFIX),
        "FASTCOMM_TRACE_SIGNAL": "USR1",
        "FASTCOMM_TRACE_PYTHON_STACK": "1",
    }
    res = run_ranks(2, ring_fn, outdir, init=False, env=env, timeout_s=180)
    for rank, r in enumerate(res):
        assert r["default_path"] == os.path.join(outdir, f"{PREFIX}{rank}")
        assert os.path.exists(r["custom_path"]) and r["custom_path"].endswith(f"mine{rank}")
        assert r["signal_reason"] is not None and r["signal_reason"].startswith("signal 10"), r
        assert r["no_group_raises"]
        d = r["on_demand"]
        assert d["version"] == "2.10" and d["rank"] == rank and d["dump_reason"] == "on demand"
        cfg = d["pg_config"]
        assert set(cfg) == {"0", r["sub_name"]}, cfg  # the group created with 0 entries: absent
        assert cfg["0"]["desc"] == "default_pg" and cfg["0"]["ranks"] == "[0, 1]"
        assert cfg[r["sub_name"]]["ranks"] == "[0, 1]"
        world = [e for e in d["entries"] if e["process_group"][0] == "0"]
        # 15 ops on the world group, 8 kept: seq 8..14 and the point-to-point op.
        assert len(world) == 8, [e["profiling_name"] for e in world]
        colls = [e for e in world if not e["is_p2p"]]
        assert [e["collective_seq_id"] for e in colls] == list(range(8, 15))
        names = [e["profiling_name"] for e in world]
        p2p = "fastcomm:send 0->1" if rank == 0 else "fastcomm:recv 1<-0"
        assert names == ["fastcomm:all_reduce"] * 3 + [
            "fastcomm:broadcast",
            p2p,
            "fastcomm:all_gather",
            "fastcomm:_reduce_scatter_base",
            "fastcomm:barrier",
        ], names
        by = {n: e for n, e in zip(names, world)}
        ar, bc, ag, rs = (
            by["fastcomm:all_reduce"],
            by["fastcomm:broadcast"],
            by["fastcomm:all_gather"],
            by["fastcomm:_reduce_scatter_base"],
        )
        assert ar["input_sizes"] == [[2, 3]] == ar["output_sizes"] and ar["input_dtypes"] == [
            "Float"
        ]
        assert ar["reduce_op"] == "SUM" and ar["root"] is None
        assert bc["root"] == 1 and bc["input_dtypes"] == ["Double"] and bc["reduce_op"] is None
        assert ag["input_sizes"] == [[4]] and ag["output_sizes"] == [[4], [4]]
        assert ag["output_dtypes"] == ["Int", "Int"]
        assert rs["input_sizes"] == [[4]] and rs["output_sizes"] == [[2]]
        assert rs["reduce_op"] == "MAX" and rs["input_dtypes"] == ["BFloat16"]
        pe = by[p2p]
        assert pe["is_p2p"] and pe["p2p_seq_id"] == 1 and pe["collective_seq_id"] == 11
        assert (pe["input_sizes"], pe["output_sizes"]) == (
            ([[3]], []) if rank == 0 else ([], [[3]])
        )
        ids = [e["record_id"] for e in d["entries"]]
        assert ids == sorted(ids)
        for e in world:
            assert e["state"] == "completed" and e["retired"], e
            assert e["timeout_ms"] == 60000
            assert (
                e["time_created_ns"]
                <= e["time_discovered_started_ns"]
                <= e["time_discovered_completed_ns"]
            )
            assert e["duration_ms"] >= 0
            # FASTCOMM_TRACE_PYTHON_STACK=1: the caller's frames.
            assert any(f["name"] == "ring_fn" for f in e["frames"]), e["frames"]
        sub = [e for e in d["entries"] if e["process_group"][0] == r["sub_name"]]
        assert [(e["collective_seq_id"], e["reduce_op"]) for e in sub] == [(1, "MAX")]

    from torchext import trace_analysis

    dumps, notes = trace_analysis.load_dumps(outdir, PREFIX)
    assert sorted(dumps) == [0, 1], notes
    report = trace_analysis.analyse(dumps, notes)
    assert report.findings == [] and report.culprits == [], report.text()


# ------------------------------------------------------------------------- scripted hangs

HANG_TIMEOUT_S = 3.0
CASES = ("skip", "shape", "peer_library")


def hangs_fn(rank: int, ws: int, outdir: str) -> dict[str, Any]:
    """Each case in its own fastcomm group (recording, HANG_TIMEOUT_S); the world group, which
    the cases coordinate through, records nothing."""
    import torchext  # noqa: F401

    _with_env(
        {"FASTCOMM_TRACE_BUFFER_SIZE": "0"},
        lambda: dist.init_process_group(backend="fastcomm", timeout=timedelta(seconds=60)),
    )
    store = dist.distributed_c10d._get_default_store()
    gloo = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    out: dict[str, Any] = {}
    for case in CASES:
        env = {
            "FASTCOMM_TRACE_BUFFER_SIZE": "64",
            "FASTCOMM_TRACE_FILE": os.path.join(outdir, case, PREFIX),
        }
        g = _with_env(
            env,
            lambda: dist.new_group(backend="fastcomm", timeout=timedelta(seconds=HANG_TIMEOUT_S)),
        )
        for _ in range(3):
            dist.all_reduce(torch.ones(4), group=g)
        start = time.time_ns()
        path = os.path.join(outdir, case, f"{PREFIX}{rank}")
        error = None
        dumped_before_error = False
        try:
            if case == "skip":
                if rank != 1:
                    dist.all_reduce(torch.ones(4), group=g)
            elif case == "shape":  # past the one-shot size: the longer one waits for chunks
                dist.all_reduce(torch.ones((1 << 18) * (2 if rank == 1 else 1)), group=g)
            elif rank == 1:  # stuck in gloo until the others are done with fastcomm
                dist.all_reduce(torch.ones(4), group=gloo)
            else:
                try:
                    dist.all_reduce(torch.ones(4), group=g)
                finally:
                    dist.all_reduce(torch.ones(4), group=gloo)
        except RuntimeError as e:
            error = str(e)
            dumped_before_error = os.path.exists(path) and _load(path)["time_ns"] > start
        # Written before the timeout error was raised, or at a peer's request.
        dump = _wait_for_dump(path, start, 20)
        out[case] = {
            "error": error,
            "dumped_before_error": dumped_before_error,
            "reason": None if dump is None else dump["dump_reason"],
            "failure": None if dump is None else dump["failure"],
        }
        store.set(f"fr_test/{case}/{rank}", "1")
        store.wait([f"fr_test/{case}/{r}" for r in range(ws)])
        time.sleep(1.5)  # the last dump requests settle before the next case's group exists
        dist.destroy_process_group(g)
    dist.destroy_process_group()
    return out


def test_scripted_hangs_name_the_culprit(tmp_path: Any) -> None:
    from torchext import trace_analysis

    outdir = str(tmp_path)
    res = run_ranks(3, hangs_fn, outdir, init=False, timeout_s=240)
    for case in CASES:
        for rank in range(3):
            r = res[rank][case]
            assert r["reason"] is not None, f"{case}: rank {rank} wrote no dump: {r}"
        if case in ("skip", "peer_library"):
            for rank in (0, 2):  # the group's timeout error, naming the missing rank
                err = res[rank][case]["error"] or ""
                assert "timeout" in err and "[1]" in err and "all_reduce" in err, err
                assert res[rank][case]["failure"], res[rank][case]
                assert res[rank][case]["dumped_before_error"], res[rank][case]
            assert res[1][case]["error"] is None
            assert res[1][case]["reason"].startswith("asked by a peer"), res[1][case]
        else:
            assert any(res[r][case]["error"] for r in range(3)), [res[r][case] for r in range(3)]
        dumps, notes = trace_analysis.load_dumps(os.path.join(outdir, case))
        report = trace_analysis.analyse(dumps, notes)
        text = report.text()
        assert report.culprits == [1], f"{case}:\n{text}"
        first = report.findings[0]
        assert (first.seq, first.op) == (4, "all_reduce"), f"{case}:\n{text}"
        assert first.kind == ("mismatch" if case == "shape" else "not_reached"), text
        states = {s.rank: s for s in report.ranks}
        assert states[1].last_completed is not None and "#3 all_reduce" in states[1].last_completed

    # The command line: the report and a nonzero exit status.
    proc = subprocess.run(
        [sys.executable, "-m", "torchext.trace_analysis", os.path.join(outdir, "skip", PREFIX)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")},
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "culprit: rank(s) [1]" in proc.stdout and "#4 all_reduce" in proc.stdout, proc.stdout


def gpu_peer_library_fn(rank: int, ws: int, outdir: str) -> dict[str, Any]:
    """Rank 1 waits inside an NCCL group's all_reduce while rank 0 waits in fastcomm's."""
    import torchext  # noqa: F401

    torch.cuda.set_device(rank)
    _with_env(
        {"FASTCOMM_TRACE_BUFFER_SIZE": "0"},
        lambda: dist.init_process_group(backend="fastcomm", timeout=timedelta(seconds=120)),
    )
    nccl = dist.new_group(backend="nccl")
    g = _with_env(
        {"FASTCOMM_TRACE_BUFFER_SIZE": "64", "FASTCOMM_TRACE_FILE": os.path.join(outdir, PREFIX)},
        lambda: dist.new_group(backend="fastcomm", timeout=timedelta(seconds=HANG_TIMEOUT_S + 2)),
    )
    x = torch.ones(1024, device="cuda")
    for _ in range(3):
        dist.all_reduce(x, group=g)
    dist.all_reduce(x, group=nccl)
    torch.cuda.synchronize()
    start = time.time_ns()
    path = os.path.join(outdir, f"{PREFIX}{rank}")
    error = None
    dumped_before_error = False
    if rank == 1:
        dist.all_reduce(x, group=nccl)
        torch.cuda.synchronize()
    else:
        try:
            dist.all_reduce(x, group=g, async_op=True).wait()  # FASTCOMM_BLOCKING_WAIT=1
            torch.cuda.synchronize()
        except RuntimeError as e:
            error = str(e)
            dumped_before_error = os.path.exists(path) and _load(path)["time_ns"] > start
        dist.all_reduce(x, group=nccl)  # lets rank 1 go
        torch.cuda.synchronize()
    dump = _wait_for_dump(path, start, 30)
    store = dist.distributed_c10d._get_default_store()
    store.set(f"fr_gpu/{rank}", "1")
    store.wait([f"fr_gpu/{r}" for r in range(ws)])
    time.sleep(1.5)
    dist.destroy_process_group()
    return {
        "error": error,
        "dumped_before_error": dumped_before_error,
        "reason": None if dump is None else dump["dump_reason"],
    }


@pytest.mark.cuda(world_size=2)
def test_gpu_rank_stuck_in_nccl_is_named(tmp_path: Any) -> None:
    from torchext import trace_analysis

    outdir = str(tmp_path)
    res = run_ranks(
        2,
        gpu_peer_library_fn,
        outdir,
        init=False,
        timeout_s=240,
        env={"FASTCOMM_BLOCKING_WAIT": "1"},
    )
    assert res[0]["error"] and "timeout" in res[0]["error"], res[0]
    assert res[0]["dumped_before_error"], res[0]
    assert res[1]["reason"] and res[1]["reason"].startswith("asked by a peer"), res[1]
    dumps, notes = trace_analysis.load_dumps(outdir, PREFIX)
    report = trace_analysis.analyse(dumps, notes)
    assert report.culprits == [1], report.text()
    assert (report.findings[0].seq, report.findings[0].kind) == (4, "not_reached"), report.text()
