"""Tail latency of the CUDA all_reduce across nodes under several settings, with TCP counters.

Run on the shaped-link testbed, one rank per node; each setting gets a process group of its own
(the settings are read when a group is created). Per setting and size it prints the median and
mean time per call, how many calls took over 3x the median, the TCP retransmissions of this
node's namespace meanwhile, and first the plain-TCP throughput between the two nodes:

    python benchmarks/netbed.py --rate 25gbit --device cuda --nproc-per-node 1 -- \
        benchmarks/tools/staged_settings_probe.py 25gbit

DIAG_CPU=1 runs it on CPU tensors (the host path instead of the staged rail), with 8, 4 and 2
sockets.
"""

import os, sys, time, socket, threading, statistics
import torch, torch.distributed as dist
import torchext  # noqa

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
CPU = os.environ.get("DIAG_CPU") == "1"
DEV = "cpu" if CPU else "cuda"
if not CPU:
    torch.cuda.set_device(0)


def sync():
    if not CPU:
        torch.cuda.synchronize()


KEYS = [
    "RetransSegs",
    "TCPLossProbes",
    "TCPTimeouts",
    "TCPFastRetrans",
    "TCPSlowStartRetrans",
    "DelayedACKs",
    "TCPSpuriousRTOs",
    "TCPLostRetransmit",
    "TCPSackRecovery",
    "TCPLossProbeRecovery",
]


def netstat():
    out = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        lines = open(path).read().splitlines()
        for a, b in zip(lines[::2], lines[1::2]):
            for k, v in zip(a.split()[1:], b.split()[1:]):
                if k in KEYS:
                    out[k] = int(v)
    return out


def raw_tcp(streams, secs=1.0, port=39000):
    peer = 1 - rank
    me_addr, peer_addr = f"10.77.0.{rank + 1}", f"10.77.0.{peer + 1}"
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((me_addr, port + streams))
    srv.listen(64)
    dist.barrier()
    outs = []
    for _ in range(streams):
        s = socket.socket()
        s.connect((peer_addr, port + streams))
        outs.append(s)
    ins = [srv.accept()[0] for _ in range(streams)]
    dist.barrier()
    got = [0] * streams
    stop = time.perf_counter() + secs
    buf = memoryview(bytearray(4 << 20))

    def send(s):
        while time.perf_counter() < stop:
            s.sendall(buf)
        s.shutdown(socket.SHUT_WR)

    def recv(i, s):
        b = bytearray(4 << 20)
        m = memoryview(b)
        while True:
            n = s.recv_into(m)
            if not n:
                break
            if time.perf_counter() < stop:
                got[i] += n

    th = [threading.Thread(target=send, args=(s,)) for s in outs] + [
        threading.Thread(target=recv, args=(i, s)) for i, s in enumerate(ins)
    ]
    for t in th:
        t.start()
    for t in th:
        t.join()
    for s in outs + ins + [srv]:
        s.close()
    return sum(got) / secs / 1e9


dist.init_process_group("fastcomm", **({} if CPU else {"device_id": torch.device("cuda", 0)}))
if rank == 0:
    print("# link:", sys.argv[1:], flush=True)


def softnet_drops():
    return sum(int(l.split()[1], 16) for l in open("/proc/net/softnet_stat"))


if rank == 0:
    print(
        "# netdev_max_backlog",
        (
            open("/proc/sys/net/core/netdev_max_backlog").read().strip()
            if os.path.exists("/proc/sys/net/core/netdev_max_backlog")
            else "n/a"
        ),
        "softnet drops",
        softnet_drops(),
        flush=True,
    )
for streams in (1, 4):
    try:
        bw = raw_tcp(streams, port=39000 + 100 * streams)
    except Exception as e:
        print(f"rank {rank} raw TCP {streams} streams failed: {e!r}", flush=True)
        bw = 0.0
    t = torch.tensor([bw], device=DEV)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(
            f"raw TCP both ways, {streams} streams each way: {t.item():.3f} GB/s per direction (min over ranks)",
            flush=True,
        )


def C(s, c, **kw):
    d = {"FASTCOMM_TCP_SOCKETS": str(s), "FASTCOMM_CUDA_CHUNK_BYTES": c}
    d.update(kw)
    return d


configs = [
    C(8, "4M"),
    C(2, "1M"),
    C(4, "1M"),
    C(4, "2M"),
    C(8, "1M"),
    C(2, "2M"),
    C(2, "1M", FASTCOMM_CUDA_HIER_MIN_BYTES="256K"),
    C(4, "1M", FASTCOMM_CUDA_WINDOW="12"),
]
if CPU:  # the chunk and window settings are the staged rail's: only the socket count applies
    configs = [C(s, "4M") for s in (8, 4, 2)]
for cfg in configs:
    saved = {k: os.environ.get(k) for k in cfg}
    os.environ.update(cfg)
    g = dist.new_group(backend="fastcomm")
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    for size, n in (
        (256 << 10, 300),
        (1 << 20, 300),
        (4 << 20, 100),
        (16 << 20, 40),
        (256 << 20, 6),
    ):
        x = torch.randn(size // 4, device=DEV)
        for _ in range(5):
            dist.all_reduce(x, group=g)
        sync()
        dist.barrier(group=g)
        before = netstat()
        sd0 = softnet_drops()
        times = []
        t00 = time.perf_counter()
        for _ in range(n):
            t0 = time.perf_counter()
            dist.all_reduce(x, group=g)
            sync()
            times.append((time.perf_counter() - t0) * 1e6)
        total = (time.perf_counter() - t00) * 1e6
        after = netstat()
        diff_sd = softnet_drops() - sd0
        diff = {
            k: after.get(k, 0) - before.get(k, 0)
            for k in KEYS
            if after.get(k, 0) != before.get(k, 0)
        }
        tt = torch.tensor(
            [
                statistics.median(times),
                total / n,
                max(times),
                sum(t > 3 * statistics.median(times) for t in times),
            ],
            device=DEV,
            dtype=torch.float64,
        )
        dist.all_reduce(tt, op=dist.ReduceOp.MAX, group=g)
        med, mean, mx, slow = tt.tolist()
        if rank == 0:
            print(
                f"{' '.join(k[9:] + '=' + v for k, v in cfg.items()):70s} {size >> 10:>7} KiB  median {med:9.1f} us  mean {mean:9.1f}  busbw(mean) {size / mean / 1e3:6.2f} GB/s  max {mx:9.1f}  slow(>3x med) {int(slow):3d}/{n}  softnet drops {diff_sd} tcp r0 {diff}",
                flush=True,
            )
    dist.destroy_process_group(g)
dist.destroy_process_group()
