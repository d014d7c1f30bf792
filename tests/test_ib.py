"""The ib transport beyond the shared transport suite (test_transport.py runs that suite
over ib too): zero-copy through registered memory and the registration cache, injected
queue-pair faults failing every rank with a clear error and no hang, device selection
(FASTCOMM_IB_HCA, FASTCOMM_IB_GID_INDEX), FASTCOMM_TRANSPORT=auto/ib in process groups
spanning simulated nodes, and an extension that loads without rdma-core.

There is no RDMA hardware here: the ranks run the ib protocol on the software RC device
(FASTCOMM_IB_EMULATE=1, csrc/inter/ib/emu_device.hpp).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import pytest

from _harness import BACKEND, Checker, capture_stderr, gen, gloo_skip, is_gloo, run_ranks
from test_transport import _barrier, _endpoint, _finish, _payload, _store

pytestmark = gloo_skip("fastcomm's ib transport")

EMU = {"FASTCOMM_IB_EMULATE": "1"}


# ------------------------------------------------------------------------------ zero copy


def _exchange(
    ep: Any, rank: int, peer: int, src: torch.Tensor, mr_src: Any, dst: torch.Tensor, mr_dst: Any
) -> None:
    """Sends `src` to `peer` and receives its message into `dst` (rank 0 sends first)."""
    if rank == 0:
        ep.isend(peer, src, mr_src).wait()
        ep.irecv(peer, dst, mr_dst).wait()
    else:
        ep.irecv(peer, dst, mr_dst).wait()
        ep.isend(peer, src, mr_src).wait()


def _zero_copy(rank: int, world: int) -> None:
    import torch

    chk = Checker(f"rank {rank}")
    store = _store(rank, world)
    ep = _endpoint(store, rank, world, "ib")
    peer = 1 - rank
    n = (3 << 20) + 5  # several 512 KiB pieces, and a tail
    src = _payload(n, "zc", rank, peer).clone()
    dst = torch.zeros(n, dtype=torch.uint8)
    big_src = torch.zeros(2 * n, dtype=torch.uint8)
    big_src[n // 2 : n // 2 + n] = src
    c0 = ep.counters()
    chk.true(c0["emulated"] == 1, f"not on the emulation: {c0}")

    # Both sides registered: every byte moves zero-copy, none through staging.
    mr_src = ep.register_memory(big_src)
    mr_dst = ep.register_memory(dst)
    view = big_src[n // 2 : n // 2 + n]
    # A sub-range of a registered buffer reuses its registration.
    mr_view = ep.register_memory(view)
    c1 = ep.counters()
    chk.true(c1["reg_cache_misses"] - c0["reg_cache_misses"] == 2, f"misses: {c0} -> {c1}")
    chk.true(c1["reg_cache_hits"] - c0["reg_cache_hits"] == 1, f"hits: {c0} -> {c1}")
    hr = ep.irecv(peer, dst, mr_dst)
    hs = ep.isend(peer, view, mr_view)
    hr.wait()
    hs.wait()
    chk.equal(dst, _payload(n, "zc", peer, rank), "zero-copy: data")
    c2 = ep.counters()
    chk.true(c2["staged_bytes"] == c1["staged_bytes"], f"registered both ways staged: {c1} -> {c2}")
    # Sender and receiver each count the bytes they moved without a copy.
    chk.true(c2["zero_copy_bytes"] - c1["zero_copy_bytes"] == 2 * n, f"zero-copy: {c1} -> {c2}")

    # Registered on one side only: the other side stages, data still right.
    dst2 = torch.zeros(n, dtype=torch.uint8)
    if rank == 0:
        ep.isend(peer, view, mr_view).wait()
        ep.irecv(peer, dst2).wait()
    else:
        ep.irecv(peer, dst2).wait()
        ep.isend(peer, view, mr_view).wait()
    chk.equal(dst2, _payload(n, "zc", peer, rank), "half-registered: data")
    c3 = ep.counters()
    chk.true(c3["staged_bytes"] - c2["staged_bytes"] == n, f"one side staged: {c2} -> {c3}")
    chk.true(
        c3["zero_copy_bytes"] - c2["zero_copy_bytes"] == n, f"one side zero-copy: {c2} -> {c3}"
    )

    # A registration of another range does not cover the tensor: staged, still right.
    other = torch.zeros(4096, dtype=torch.uint8)
    mr_other = ep.register_memory(other)
    dst3 = torch.zeros(n, dtype=torch.uint8)
    ep.exchange([(peer, src)], [(peer, dst3)])
    chk.equal(dst3, _payload(n, "zc", peer, rank), "unregistered: data")

    # Dropping the last handle on a registration (requests hold theirs) deregisters it.
    del hr, hs, mr_view, mr_src, mr_other
    c4 = ep.counters()
    chk.true(c4["reg_cache_entries"] == 1, f"entries after releasing: {c4}")
    del mr_dst
    chk.true(ep.counters()["reg_cache_entries"] == 0, f"entries: {ep.counters()}")
    ep.close()
    _finish(store, rank, world)
    chk.raise_if_failed()


def test_zero_copy_and_registration_cache() -> None:
    """Registered tensors move without staging copies (sub-ranges reuse a registration),
    unregistered ones go through staging slots, and the data is right either way."""
    run_ranks(2, _zero_copy, init=False, timeout_s=120, env=EMU)


# ------------------------------------------------------------------------------ GPUDirect RDMA

# Device-memory sizes: empty, tiny, odd, a piece striped over the QPs (>= 64 KiB per
# stripe), and several MiB spanning more than one 8 MiB zero-copy piece.
GDR_SIZES = [0, 1, 7, 4097, (512 << 10) + 13, 3 << 20, (17 << 20) + 3]


def test_device_memory_registration_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device registration says clearly why it cannot work: FASTCOMM_IB_GDR=0, no usable
    CUDA (CPU machines, CPU-only builds), memory that is not device memory, and tcp."""
    import torch
    import torch.distributed as dist
    import torchext._testing as C

    store = dist.HashStore()
    host = torch.zeros(4096, dtype=torch.uint8)
    monkeypatch.setenv("FASTCOMM_IB_EMULATE", "1")

    monkeypatch.setenv("FASTCOMM_IB_GDR", "0")
    ep = C._TransportEndpoint(store, 0, 1, name="ib", prefix="gdr-off")
    assert not ep.supports_device_memory
    with pytest.raises(RuntimeError, match="GPUDirect RDMA is off \\(FASTCOMM_IB_GDR=0\\)"):
        ep.register_memory(host, device=True)
    assert ep.register_memory(host).nbytes == 4096  # host registration is unaffected
    ep.close()

    monkeypatch.delenv("FASTCOMM_IB_GDR")
    ep = C._TransportEndpoint(store, 0, 1, name="ib", prefix="gdr-on")
    if torch.cuda.is_available():
        # The emulation moves device memory with cudaMemcpy where CUDA works...
        assert ep.supports_device_memory
        # (This process has no CUDA context unless an earlier test made one.)
        with pytest.raises(
            RuntimeError, match="as device memory: (it is host memory|no CUDA context exists)"
        ):
            ep.register_memory(host, device=True)
    else:
        # ...and says why not elsewhere (no GPU, no driver, or a CPU-only build).
        assert not ep.supports_device_memory
        with pytest.raises(RuntimeError, match="GPUDirect RDMA is not available: .*CUDA"):
            ep.register_memory(host, device=True)
    ep.close()

    ep = C._TransportEndpoint(store, 0, 1, name="tcp", prefix="gdr-tcp")
    assert not ep.supports_device_memory
    with pytest.raises(RuntimeError, match="tcp transport cannot register device memory"):
        ep.register_memory(host, device=True)
    ep.close()


def _device_memory(rank: int, world: int) -> None:
    import torch

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    chk = Checker(f"rank {rank}")
    store = _store(rank, world)
    peer = 1 - rank
    for config in (None, {"FASTCOMM_IB_QPS_PER_PEER": "4"}):
        tag = f"gdr{config}"
        ep = _endpoint(store, rank, world, "ib", config)
        chk.true(ep.supports_device_memory, f"{tag}: no device memory on the emulation")
        c0 = ep.counters()
        total = 0
        for i, n in enumerate(GDR_SIZES):
            src = _payload(n, tag, rank, peer, i).to(dev)
            dst = torch.full((n,), 0xA5, dtype=torch.uint8, device=dev)
            # The sender's buffer is recognised as device memory (cudaPointerGetAttributes),
            # the receiver's registered explicitly as device memory.
            mr_src = ep.register_memory(src)
            mr_dst = ep.register_memory(dst, device=True)
            torch.cuda.synchronize()  # the transport reads src outside torch's streams
            hr = ep.irecv(peer, dst, mr_dst)
            hs = ep.isend(peer, src, mr_src)
            hr.wait()
            hs.wait()
            chk.equal(dst.cpu(), _payload(n, tag, peer, rank, i), f"{tag}: {n} bytes GPU->GPU")
            total += n
            del mr_src, mr_dst, hr, hs
        c1 = ep.counters()
        chk.true(c1["staged_bytes"] == c0["staged_bytes"], f"{tag}: staged: {c0} -> {c1}")
        chk.true(
            c1["zero_copy_bytes"] - c0["zero_copy_bytes"] == 2 * total,
            f"{tag}: zero-copy bytes {c0} -> {c1}, expected {2 * total}",
        )
        chk.true(c1["reg_cache_entries"] == 0, f"{tag}: registrations left: {c1}")

        # Device memory to registered host memory and back (the emulated HCA's
        # device-to-wire and wire-to-device copies on opposite sides).
        n = (5 << 20) + 11
        src_dev = _payload(n, tag, "d2h", rank).to(dev)
        dst_host = torch.zeros(n, dtype=torch.uint8)
        mr_sd, mr_dh = ep.register_memory(src_dev), ep.register_memory(dst_host)
        torch.cuda.synchronize()
        _exchange(ep, rank, peer, src_dev, mr_sd, dst_host, mr_dh)
        chk.equal(dst_host, _payload(n, tag, "d2h", peer), f"{tag}: GPU -> host")
        src_host = _payload(n, tag, "h2d", rank).clone()
        dst_dev = torch.zeros(n, dtype=torch.uint8, device=dev)
        mr_sh, mr_dd = ep.register_memory(src_host), ep.register_memory(dst_dev)
        _exchange(ep, rank, peer, src_host, mr_sh, dst_dev, mr_dd)
        chk.equal(dst_dev.cpu(), _payload(n, tag, "h2d", peer), f"{tag}: host -> GPU")

        # A device buffer outside the registration given with it cannot be staged.
        other = torch.zeros(64, dtype=torch.uint8, device=dev)
        try:
            ep.isend(peer, other, mr_sd)
            chk.fail(f"{tag}: device buffer outside its registration accepted")
        except ValueError as e:
            chk.true("inside its registration" in str(e), f"{tag}: error: {e}")
        del mr_sd, mr_dh, mr_sh, mr_dd
        ep.close()
        del ep

    # FASTCOMM_IB_GDR=0: device memory is refused, naming the setting.
    ep = _endpoint(store, rank, world, "ib", {"FASTCOMM_IB_GDR": "0"})
    chk.true(not ep.supports_device_memory, "FASTCOMM_IB_GDR=0: still supports device memory")
    gpu = torch.zeros(4096, dtype=torch.uint8, device=dev)
    try:
        ep.register_memory(gpu)
        chk.fail("FASTCOMM_IB_GDR=0: device memory registered")
    except RuntimeError as e:
        chk.true("FASTCOMM_IB_GDR=0" in str(e), f"FASTCOMM_IB_GDR=0: error: {e}")
    ep.close()
    _finish(store, rank, world)
    chk.raise_if_failed()


@pytest.mark.cuda(2)
def test_device_memory_send_recv() -> None:
    """GPUDirect RDMA end to end on the emulation: device-memory buffers registered on both
    sides (sizes 0 to 17 MiB, 2 and 4 QPs) arrive intact and move zero-copy; device to
    host and host to device; FASTCOMM_IB_GDR=0 refuses device memory."""
    run_ranks(2, _device_memory, init=False, timeout_s=180, env=EMU)


# About 5 s of torch.cuda._sleep on a ~2 GHz GPU (H100/H200), far longer than the transfer.
BUSY_CYCLES = 10_000_000_000


def _device_memory_busy_gpu(rank: int, world: int) -> None:
    import torch

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    chk = Checker(f"rank {rank}")
    store = _store(rank, world)
    peer = 1 - rank
    ep = _endpoint(store, rank, world, "ib", None)
    n = (8 << 20) + 5
    # Everything that allocates or registers (page-locked bounce buffers, streams) first.
    src = _payload(n, "busy", rank, peer).to(dev)
    dst = torch.zeros(n, dtype=torch.uint8, device=dev)
    mr_src, mr_dst = ep.register_memory(src), ep.register_memory(dst, device=True)
    side = torch.cuda.Stream(device=dev)
    torch.cuda.synchronize()
    _barrier(store, world, "busy")
    # Another stream of this GPU is busy (as the staged all_reduce's comm stream sits in a
    # wait that only this transfer's arrival releases): the emulated HCA's device copies
    # must run beside it, not after it.
    with torch.cuda.stream(side):
        torch.cuda._sleep(BUSY_CYCLES)
    t0 = time.monotonic()
    hr = ep.irecv(peer, dst, mr_dst)
    hs = ep.isend(peer, src, mr_src)
    hr.wait()
    hs.wait()
    took = time.monotonic() - t0
    still_busy = not side.query()
    side.synchronize()
    chk.true(
        still_busy,
        f"the transfer took {took:.2f} s and ended only after the other stream's kernel: the "
        "emulated HCA's copies waited for unrelated work of the GPU",
    )
    chk.equal(dst.cpu(), _payload(n, "busy", peer, rank), "GPU->GPU beside a busy stream")
    del mr_src, mr_dst, hr, hs
    ep.close()
    _finish(store, rank, world)
    chk.raise_if_failed()


@pytest.mark.cuda(2)
def test_device_memory_beside_busy_stream() -> None:
    """The emulated HCA moves device memory while another stream of the same GPU is busy:
    its copies are ordinary asynchronous ones (page-locked bounce buffer, a non-blocking
    stream of its own), never ordered behind other work of the GPU, which may be waiting
    for this very transfer (the staged CUDA all_reduce's comm stream)."""
    run_ranks(2, _device_memory_busy_gpu, init=False, timeout_s=180, env=EMU)


# ------------------------------------------------------------------------------ faults


def _fault(
    rank: int, world: int, injector: int, fault: str, needles: dict[int, list[str]]
) -> float:
    import torch
    import torchext._testing as T

    chk = Checker(f"rank {rank}")
    if rank == injector:
        T.ib_emu_fail(fault)  # before the transport opens its device
    store = _store(rank, world)
    ep = _endpoint(store, rank, world, "ib", timeout=timedelta(seconds=60))
    peers = [p for p in range(world) if p != rank]
    # Well before the fault: a few exchanges work.
    for i in range(2):
        ep.exchange(
            [(p, _payload(4096, "warm", i, rank, p)) for p in peers],
            [(p, torch.empty(4096, dtype=torch.uint8)) for p in peers],
        )
    _barrier(store, world, "warm")
    big = 16 << 20
    t0 = time.monotonic()
    # Every rank moves data to every other, long past the fault's trigger.
    others = [p for p in peers if p == injector or rank == injector]
    msg = ""
    try:
        for i in range(20):
            ep.exchange(
                [(p, torch.full((big,), i, dtype=torch.uint8)) for p in others],
                [(p, torch.empty(big, dtype=torch.uint8)) for p in others],
            )
        chk.fail("no error after the injected fault")
    except RuntimeError as e:
        msg = str(e)
    elapsed = time.monotonic() - t0
    for needle in needles[rank if rank == injector else -1]:
        chk.true(needle in msg, f"error does not mention {needle!r}: {msg}")
    chk.true(elapsed < 15, f"the fault took {elapsed:.1f} s to show: {msg}")
    ep.close()
    _finish(store, rank, world)
    chk.raise_if_failed()
    return elapsed


@pytest.mark.parametrize(
    "fault,needles",
    [
        pytest.param(
            "qp_error:after=5",
            {
                # The injecting rank's QP went to the error state under it ...
                1: ["rank 0", "IBV_EVENT_QP_FATAL"],
                # ... and its peer's writes are no longer acknowledged.
                -1: ["rank 1", "IBV_WC_RETRY_EXC_ERR", "the peer closed or is unreachable"],
            },
            id="qp_error",
        ),
        pytest.param(
            "bad_rkey:after=5",
            {
                # The requester's write is NAKed ...
                1: ["rank 0", "IBV_WC_REM_ACCESS_ERR", "rejected an RDMA write"],
                # ... and the responder's QP reports the access violation.
                -1: ["rank 1", "IBV_EVENT_QP_ACCESS_ERR"],
            },
            id="bad_rkey",
        ),
    ],
)
def test_injected_fault_fails_both_ranks(fault: str, needles: dict[int, list[str]]) -> None:
    """A fault injected on rank 1 (torchext._testing.ib_emu_fail): a QP going to the error
    state, or a write with a corrupted rkey, fails the transfers on both ranks within
    seconds, each error naming the other rank and what the hardware would report."""
    res = run_ranks(2, _fault, 1, fault, needles, init=False, timeout_s=120, env=EMU)
    assert all(t < 15 for t in res), res


def test_fault_spec_is_checked() -> None:
    """ib_emu_fail rejects a spec it does not know instead of injecting nothing."""
    import torchext._testing as T

    for bad in ["qp_eror:after=3", "qp_error:afterwards=3", "bad_rkey:after=", "qp_error:after=-1"]:
        with pytest.raises(ValueError, match="expected qp_error:after=N"):
            T.ib_emu_fail(bad)
    T.ib_emu_fail("none")


# ------------------------------------------------------------------------------ device choice


def test_device_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """FASTCOMM_IB_HCA filters devices and ports (prefix, =exact, ^exclude, :port);
    FASTCOMM_IB_GID_INDEX must name a GID of the port."""
    import torch.distributed as dist
    import torchext._testing as C

    monkeypatch.setenv("FASTCOMM_IB_EMULATE", "1")
    cases = {
        "": True,
        "fcemu": True,
        "fcemu0:1": True,
        "mlx5_0,fcemu0": True,
        "=fcemu0": True,
        "=fcemu": False,
        "fcemu0:2": False,
        "mlx5": False,
        "^fcemu0": False,
        "^mlx5": True,
    }
    for hca, want in cases.items():
        monkeypatch.setenv("FASTCOMM_IB_HCA", hca)
        usable, why = C._transport_usable("ib")
        assert usable == want, (hca, why)
        if not want:
            assert f"FASTCOMM_IB_HCA={hca}" in why, why
    monkeypatch.delenv("FASTCOMM_IB_HCA")
    store = dist.HashStore()
    monkeypatch.setenv("FASTCOMM_IB_GID_INDEX", "9")
    with pytest.raises(RuntimeError, match="FASTCOMM_IB_GID_INDEX=9 is not a valid GID of fcemu0"):
        C._TransportEndpoint(store, 0, 1, name="ib", prefix="gid9")
    monkeypatch.setenv("FASTCOMM_IB_GID_INDEX", "1")
    C._TransportEndpoint(store, 0, 1, name="ib", prefix="gid1").close()
    monkeypatch.setenv("FASTCOMM_IB_GID_INDEX", "x")
    with pytest.raises(Exception, match="FASTCOMM_IB_GID_INDEX=x is not a GID index"):
        C._TransportEndpoint(store, 0, 1, name="ib", prefix="gidx")


def test_extension_loads_without_rdma_core() -> None:
    """libibverbs is opened at run time: the extension neither links it nor leaves any
    ibv_* symbol to the dynamic linker, so it imports where rdma-core is absent; and
    without a device (or library) the ib probe answers with a reason instead of failing."""
    import torchext._C
    import torchext._testing as C

    so = torchext._C.__file__
    if shutil.which("readelf") is None or shutil.which("nm") is None:
        pytest.skip("binutils (readelf, nm) not installed")
    needed = subprocess.run(["readelf", "-d", so], capture_output=True, text=True, check=True)
    assert "ibverbs" not in needed.stdout, needed.stdout
    undef = subprocess.run(
        ["nm", "-D", "--undefined-only", so], capture_output=True, text=True, check=True
    )
    ibv = [line for line in undef.stdout.splitlines() if "ibv_" in line]
    assert not ibv, ibv
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTCOMM_IB")}
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torchext._testing as C; print(C._transport_usable('ib'))",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    usable, why = eval(out.stdout.strip())  # a (bool, str) tuple repr
    assert usable or why, out.stdout


# ------------------------------------------------------------------------------ process groups


def _auto_fn(rank: int, ws: int, log_dir: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    capture_stderr(os.path.join(log_dir, f"rank{rank}.log"))
    dist.init_process_group(BACKEND, timeout=timedelta(seconds=60))
    chk = Checker(f"rank {rank}")
    for n in (1000, 300_000):  # the small path and the pipelined one
        inputs = [gen(f"auto/{n}", r, (n,), torch.float32, "SUM") for r in range(ws)]
        t = inputs[rank].clone()
        dist.all_reduce(t)
        chk.reduced(t, inputs, "SUM", f"all_reduce of {n}")
    dist.destroy_process_group()
    chk.raise_if_failed()
    with open(os.path.join(log_dir, f"rank{rank}.log")) as f:
        return {"log": f.read()}


@pytest.mark.skipif(is_gloo(), reason="fastcomm's multi-node plans")
@pytest.mark.parametrize(
    "emulated,expect",
    [
        pytest.param(
            [],
            "FASTCOMM_TRANSPORT=auto: tcp, because group rank(s) [0, 1, 2, 3] have no usable "
            "ib device",
            id="no-device",
        ),
        pytest.param(
            [0, 1, 2],
            "FASTCOMM_TRANSPORT=auto: tcp, because group rank(s) [3] have no usable ib device",
            id="one-rank-without",
        ),
        pytest.param([0, 1, 2, 3], "FASTCOMM_TRANSPORT=auto: ib, every rank", id="all-emulated"),
    ],
)
def test_auto_transport(tmp_path: Any, emulated: list[int], expect: str) -> None:
    """FASTCOMM_TRANSPORT=auto over 2x2 nodes: ib only when every rank has a usable device
    (agreed through the store), else tcp with the reason logged at INFO on rank 0; the
    all_reduce is right either way."""

    def env(rank: int) -> dict[str, str]:
        e = {"FASTCOMM_HOST_ID": f"simnode{rank // 2}", "FASTCOMM_LOG": "INFO"}
        e["FASTCOMM_TRANSPORT"] = "auto"
        if rank in emulated:
            e["FASTCOMM_IB_EMULATE"] = "1"
        return e

    res = run_ranks(4, _auto_fn, str(tmp_path), init=False, timeout_s=120, env=env)
    log0 = res[0]["log"]
    assert expect in log0, log0[-3000:]
    transport = "ib" if len(emulated) == 4 else "tcp"
    # "; transport tcp (N sockets per peer);" or "; transport ib;"
    assert re.search(f"; transport {transport}[ ;]", log0), log0[-3000:]


def _forced_ib_fn(rank: int, ws: int) -> dict[str, Any]:
    import torch.distributed as dist

    # A store of its own, so that rank 0 (its host) outlives the others' init.
    store = _store(rank, ws)
    out: dict[str, Any] = {"error": None}
    try:
        dist.init_process_group(
            BACKEND, store=dist.PrefixStore("pg", store), rank=rank, world_size=ws,
            timeout=timedelta(seconds=30),
        )  # fmt: skip
        dist.destroy_process_group()
    except (RuntimeError, ValueError) as e:  # the message is what is checked
        out["error"] = f"{type(e).__name__}: {e}"
    _finish(store, rank, ws)
    return out


@pytest.mark.skipif(is_gloo(), reason="fastcomm's multi-node plans")
def test_forced_ib_without_device_fails_at_init() -> None:
    """FASTCOMM_TRANSPORT=ib where no rank has an RDMA device: init_process_group raises
    on every rank, saying why and that auto would fall back to tcp."""

    def env(rank: int) -> dict[str, str]:
        return {"FASTCOMM_HOST_ID": f"simnode{rank // 2}", "FASTCOMM_TRANSPORT": "ib"}

    res = run_ranks(4, _forced_ib_fn, init=False, timeout_s=120, env=env)
    for rank, r in enumerate(res):
        err = r["error"]
        assert err is not None, f"rank {rank}: init succeeded"
        assert "FASTCOMM_TRANSPORT=ib" in err and "no usable RDMA device" in err, err
        assert "falls back to tcp" in err, err
