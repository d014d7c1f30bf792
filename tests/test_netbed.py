"""The shaped-link testbed (benchmarks/netbed.py): 2 nodes x 2 CPU ranks, each node a network
namespace, joined by a link shaped with tc and delayed by the delay line
(benchmarks/netbed_delay.c), one torchrun per node.

Over the link, on fastcomm: every collective x dtype x op of test_collectives.py, DDP parity with
gloo, and a bulk all_reduce whose bytes the link's counters must show. The delay line holds each
direction for its delay (round trips of small messages against a plain veth pair) and passes bulk
TCP at the rate. The testbed leaves nothing behind: after a failing command, an exception, SIGTERM
of the command line tool, or the owner killed outright. The plan (names, addresses, tc commands,
environment) is checked without root. The tests that make namespaces skip, with the reason, where
that is not possible.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _harness import is_gloo, load_benchmark_module

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
TOOL = ROOT / "benchmarks" / "netbed.py"
RATE = "1gbit"  # fast enough for the case matrix on a 2-core machine
DELAY = "20us"


nb = load_benchmark_module("netbed")


@pytest.fixture(scope="module")
def tools() -> object:
    ok, why = nb.netbed_available()
    if not ok:
        pytest.skip(why)
    return nb.find_tools()


@pytest.fixture(scope="module")
def delay_line(tools: object) -> str:
    """Why the delay line cannot run here ('' where it can: TUN and a C compiler)."""
    ok, why = nb.netbed_available(delay=True)
    return "" if ok else why


@pytest.fixture(scope="module")
def link(tools: object, delay_line: str) -> object:
    """The shaped link of the tests: with a one-way delay where the delay line runs."""
    return nb.parse_link(RATE if delay_line else f"{RATE},{DELAY}")


def _leftovers(tools: object, tag: str) -> list[str]:
    """Namespaces and root-namespace links whose names carry `tag`."""
    short = tag[-4:]
    names = [ns for ns in nb.list_namespaces(tools) if tag in ns]
    links = subprocess.run(
        [tools.ip, "-o", "link", "show"], env=tools.env(), capture_output=True, text=True
    ).stdout
    return names + [line for line in links.splitlines() if f"nb{short}" in line]


# ----------------------------------------------------------------------------- no root needed


def test_rates_delays_and_link_settings() -> None:
    assert nb.parse_rate("25gbit") == 25 * 10**9
    assert nb.parse_rate("100Gbit") == 10**11
    assert nb.parse_rate("10g") == 10**10
    assert nb.parse_rate("1.5gbit") == 1_500_000_000
    assert nb.parse_rate("500mbit") == 5 * 10**8
    for bad in ("25gbps", "3GB/s", "fast", "", "1bit"):
        with pytest.raises(ValueError):
            nb.parse_rate(bad)
    assert nb.parse_delay("20us") == 20.0
    assert nb.parse_delay("20µs") == 20.0
    assert nb.parse_delay("0.05ms") == 50.0
    assert nb.parse_delay("0") == 0.0
    for bad in ("20", "20 parsecs", "-1us"):
        with pytest.raises(ValueError):
            nb.parse_delay(bad)
    link = nb.parse_link("100gbit,10us")
    assert (link.rate_bps, link.delay_us) == (10**11, 10.0)
    # the burst holds two 64 KiB segments, or 16 us at the rate when that is more
    assert nb.parse_link("1gbit").burst == 128 << 10
    assert link.burst == 200_000
    assert link.limit == 25_000_000 + 200_000  # 2 ms at 12.5 GB/s, plus the burst
    assert nb.parse_link("1gbit").limit == (4 << 20) + (128 << 10)  # the queue's floor
    assert (link.mtu, nb.parse_link("25gbit").mtu) == (1500, 1500)
    jumbo = nb.parse_link("100gbit,20us,mtu9000")
    assert (jumbo.rate_bps, jumbo.delay_us, jumbo.mtu) == (10**11, 20.0, 9000)
    assert nb.parse_link("25gbit, MTU 9000").mtu == 9000 and not nb.parse_link("25gbit,").delay_us
    for bad in ("25gbit,mtu", "25gbit,mtu100", "25gbit,mtu70000", "25gbit,9000", "25gbit,1us,2us",
                "25gbit,mtu9000,mtu1500"):  # fmt: skip
        with pytest.raises(ValueError):
            nb.parse_link(bad)


def test_tcp_counters_parse_snmp_and_netstat() -> None:
    """The counters come from the header / value line pairs of /proc/net/snmp and netstat."""
    text = (
        "Ip: Forwarding DefaultTTL\nIp: 1 64\n"
        "Tcp: RtoAlgorithm ActiveOpens RetransSegs InErrs\nTcp: 1 5 1234 0\n"
        "TcpExt: SyncookiesSent TCPTimeouts TCPLossProbes\nTcpExt: 0 17 3\n"
        "IpExt: InNoRoutes\nIpExt: 0\n"
    )
    assert nb._snmp_value(text, "Tcp:", "RetransSegs") == 1234
    assert nb._snmp_value(text, "TcpExt:", "TCPTimeouts") == 17
    assert nb._snmp_value(text, "TcpExt:", "TCPLossProbes") == 3
    assert nb._snmp_value(text, "TcpExt:", "NoSuchCounter") == 0
    assert nb._snmp_value("", "Tcp:", "RetransSegs") == 0


def test_plan_of_a_veth_pair() -> None:
    plan = nb.make_plan(2, nb.parse_link("25gbit,20us"), tag="4242-beef")
    assert [n.netns for n in plan.nodes] == ["netbed-4242-beef-n0", "netbed-4242-beef-n1"]
    assert [n.ifname for n in plan.nodes] == ["nbbeefn0", "nbbeefn1"]
    assert [n.addr for n in plan.nodes] == ["10.77.0.1", "10.77.0.2"]
    assert plan.hub is None and plan.master_addr == "10.77.0.1"
    assert all(nb.NS_RE.match(ns) for ns in plan.namespaces)
    assert all(len(n.ifname) <= 15 for n in plan.nodes)  # IFNAMSIZ
    cmds = plan.setup_commands()
    qdiscs = [c for c in cmds if c[0] == "tc"]
    # with a delay: the delay line makes the two interfaces, 20 us each way, instead of a veth
    ns0, ns1 = (n.netns for n in plan.nodes)
    # (and as many queues as delay_line_queues() gives this machine)
    q = str(nb.delay_line_queues())
    assert [c for c in cmds if c[0] == "delay"] == [
        ["delay", ns0, "nbbeefn0", ns1, "nbbeefn1", "20000", "20000", q]
    ]
    assert not any("veth" in c for c in cmds)
    assert ["ip", "-n", ns0, "link", "set", "nbbeefn0", "txqueuelen", "10000"] in cmds
    # both directions shaped: the tbf as the root on both ends
    for n in plan.nodes:
        mine = [c for c in qdiscs if n.ifname in c]
        assert len(mine) == 1, mine
        assert mine[0][mine[0].index("root") : mine[0].index("tbf") + 3] == [
            "root",
            "handle",
            "1:",
            "tbf",
            "rate",
            "25000000000bit",
        ]
    assert ["ip", "-n", "netbed-4242-beef-n1", "link", "set", "lo", "up"] in cmds
    # the link exists before it is configured, and before the tc commands that shape it
    first_set = min(i for i, c in enumerate(cmds) if c[:2] == ["ip", "-n"])
    assert next(i for i, c in enumerate(cmds) if c[0] == "delay") < first_set
    assert max(i for i, c in enumerate(cmds) if c[0] == "ip") < cmds.index(qdiscs[0])
    env = plan.node_env(1)
    assert env["FASTCOMM_HOST_ID"] == env["NCCL_HOSTID"] == "netnode1"
    for key in ("FASTCOMM_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        assert env[key] == "nbbeefn1"
    assert env["NCCL_NET"] == "Socket" and env["NCCL_IB_DISABLE"] == "1"
    # without a delay: a veth pair, the tbf as the root on both ends
    plain = nb.make_plan(2, nb.parse_link("10gbit"), tag="1-abcd").setup_commands()
    assert [c[c.index("root") + 3] for c in plain if c[0] == "tc"] == ["tbf", "tbf"]
    assert sum("veth" in c for c in plain) == 1 and not any(c[0] == "delay" for c in plain)
    # every veth end takes the link's MTU
    mtus = [c[c.index("mtu") + 1] for c in cmds if c[0] == "ip" and "mtu" in c]
    assert mtus == ["1500", "1500"]
    jumbo = nb.make_plan(2, nb.parse_link("10gbit,mtu9000"), tag="1-abcd").setup_commands()
    assert [c[c.index("mtu") + 1] for c in jumbo if c[0] == "ip" and "mtu" in c] == ["9000"] * 2
    # both ends receive with RPS over every CPU
    rps = [c for c in cmds if c[:3] == ["ip", "netns", "exec"]]
    assert [c[3] for c in rps] == [n.netns for n in plan.nodes]
    mask = nb.rps_mask(nb.usable_cpus())
    assert all(f"/sys/class/net/{n.ifname}/queues/rx-*" in c[-1] and mask in c[-1]
               for n, c in zip(plan.nodes, rps))  # fmt: skip


def test_delay_line_queues() -> None:
    """A queue per four CPUs, 1 to MAX_DELAY_QUEUES; the plan takes this machine's count."""
    assert [nb.delay_line_queues(c) for c in (1, 2, 4, 7, 8, 16, 64)] == [1, 1, 1, 1, 2, 4, 4]
    assert nb.make_plan(2, nb.parse_link("1gbit,5us")).delay_queues == nb.delay_line_queues()


def test_rps_mask() -> None:
    assert nb.rps_mask([0]) == "00000001"
    assert nb.rps_mask([0, 1]) == "00000003"
    assert nb.rps_mask(range(32)) == "ffffffff"
    assert nb.rps_mask(range(64)) == "ffffffff,ffffffff"
    assert nb.rps_mask(range(70)) == "0000003f,ffffffff,ffffffff"
    assert nb.rps_mask([1, 33]) == "00000002,00000002"


def test_plan_of_a_bridge() -> None:
    plan = nb.make_plan(3, nb.parse_link("10gbit,10us"), tag="77-0a0b")
    q = str(plan.delay_queues)
    assert plan.hub == "netbed-77-0a0b-hub" and plan.bridge == "nb0a0bbr"
    assert plan.namespaces[-1] == plan.hub
    cmds = plan.setup_commands()
    for n in plan.nodes:
        port = plan.hub_port(n.rank)
        assert ["ip", "-n", plan.hub, "link", "set", port, "master", plan.bridge] in cmds
        node_end = [c for c in cmds if c[0] == "tc" and n.ifname in c]
        hub_end = [c for c in cmds if c[0] == "tc" and port in c]
        # the rate on both ends; the delay once per path: node to hub only
        assert [c[c.index("handle") + 2] for c in node_end + hub_end] == ["tbf", "tbf"]
        assert ["delay", n.netns, n.ifname, plan.hub, port, "10000", "0", q] in cmds


def test_command_line_plan_and_torchrun_commands(capsys: pytest.CaptureFixture) -> None:
    assert nb.main(["--nodes", "2", "--rate", "100gbit", "--delay", "20us", "--plan"]) == 0
    text = capsys.readouterr().out
    assert "100 Gbit/s (12.5 GB/s) each way, 20 us one-way delay" in text
    assert "netbed_delay netbed-" in text and "tbf rate 100000000000bit" in text
    args = nb.parse_args(
        ["--nodes", "2", "--nproc-per-node", "2", "--master-port", "29555", "--", "s.py", "-x"]
    )
    assert args.command == ["s.py", "-x"]
    plan = nb.make_plan(2, args.link, tag="5-1234")
    cmds = nb.node_commands(args, plan)
    assert cmds[1][-7:] == [
        "--nnodes=2",
        "--node_rank=1",
        "--nproc_per_node=2",
        "--master_addr=10.77.0.1",
        "--master_port=29555",
        "s.py",
        "-x",
    ]
    with pytest.raises(SystemExit):
        nb.parse_args(["--rate", "25gbps", "--", "s.py"])  # bytes or bits? refused
    with pytest.raises(SystemExit):
        nb.parse_args(["--rate", "25gbit"])  # no program
    assert nb.gpu_split(2, 1, "") == ["0", "1"]
    assert nb.gpu_split(2, 2, "4,5,6,7") == ["4,5", "6,7"]
    with pytest.raises(ValueError):
        nb.gpu_split(2, 2, "0,1")


# ----------------------------------------------------------------------------- on the testbed


@pytest.mark.skipif(is_gloo(), reason="runs the fastcomm backend across the namespaces")
def test_collectives_and_ddp_over_a_shaped_link(tools: object, link: object, tmp_path) -> None:
    """2 nodes x 2 CPU ranks: every case passes, DDP matches gloo, the bytes crossed the veth."""
    env = dict(os.environ)  # torchext as the other tests find it: run from a folder of its own
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["FASTCOMM_LOG"] = "INFO"  # says where the tcp transport listens
    work = tmp_path / "work"
    work.mkdir()
    with nb.Netbed(2, link) as bed:
        cmds = nb.torchrun_commands(bed.plan, [str(TESTS / "netbed_ranks.py"), str(tmp_path)], 2)
        res = nb.launch(
            bed, cmds, env=env, nproc_per_node=2, timeout=240, quiet=True, capture=True, cwd=work
        )
    tail = "\n".join(line for lines in res.output for line in lines[-40:])
    assert res.worst == 0, f"{res.describe()}\n{tail}"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["host_id"] for r in results] == ["netnode0", "netnode0", "netnode1", "netnode1"]
    failed = {name: why for r in results for name, why in r["cases"].items() if why is not None}
    assert not failed, "\n".join(f"{k}: {v}" for k, v in list(failed.items())[:10])
    assert len(results[0]["cases"]) > 400
    assert all(r["ddp"] is None for r in results), [r["ddp"] for r in results]
    assert all(r["bulk_ok"] for r in results)
    bulk = results[0]["bulk_bytes"]
    for node, c in enumerate(res.link):
        assert c.tx_bytes >= bulk and c.rx_bytes >= bulk, (node, res.describe())
        # fastcomm's transport listened on the node's veth, never on loopback
        n = bed.nodes[node]
        listening = [line for line in res.output[node] if "tcp transport listening on" in line]
        assert len(listening) >= 2, tail
        assert all(
            f"{n.addr}:" in line and f"({n.ifname})" in line for line in listening
        ), listening
    print(f"\n[{link.describe()}: {res.describe()}]")


def test_tcp_ceiling_and_retransmit_counters(tools: object, link: object) -> None:
    """Plain TCP between two nodes gets most of the shaped rate and never more; the counters of
    each node read its own namespace's TCP."""
    with nb.Netbed(2, link) as bed:
        for n in bed.nodes:  # every veth end receives with RPS over all CPUs
            path = f"/sys/class/net/{n.ifname}/queues/rx-0/rps_cpus"
            out = subprocess.run(bed.tools.exec_prefix(n.netns) + ["cat", path],
                                 capture_output=True, text=True, check=True).stdout  # fmt: skip
            assert int(out.strip().replace(",", ""), 16) != 0, out
        before = bed.counters()
        gbps = bed.tcp_ceiling(streams=2, seconds=1.0)
        after = bed.counters()
    rate = link.rate_bps / 8 / 1e9
    assert 0.5 * rate < gbps < 1.02 * rate, (gbps, rate)
    for b, a in zip(before, after):
        assert a.tcp_retransmits >= b.tcp_retransmits >= 0
        assert a.tcp_timeouts >= b.tcp_timeouts >= 0
        assert a.veth_drops >= b.veth_drops >= 0
        assert a.tcp_rcv_drops >= b.tcp_rcv_drops >= 0
        assert a.tcp_spurious >= b.tcp_spurious >= 0
        assert a.tx_bytes - b.tx_bytes > 0.5 * gbps * 1e9


_PING_PONG = """
import socket, sys, time
me, peer, port, role = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
if role == "serve":
    s = socket.create_server((me, port))
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (d := c.recv(1)):
        c.sendall(d)
else:
    for _ in range(200):
        try:
            c = socket.create_connection((peer, port))
            break
        except OSError:
            time.sleep(0.05)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(60):
        t = time.perf_counter()
        c.sendall(b"x")
        c.recv(1)
        rtts.append(time.perf_counter() - t)
    print(sorted(rtts[10:])[len(rtts[10:]) // 2] * 1e6)
"""


def _round_trip_us(bed: object) -> float:
    """Median round trip of a one-byte TCP ping-pong from node 0 to node 1."""
    a, b = bed.nodes
    args = [a.addr, b.addr, "29123"]
    server = bed.popen(1, [sys.executable, "-c", _PING_PONG, b.addr, a.addr, "29123", "serve"],
                       dict(os.environ))  # fmt: skip
    try:
        out = subprocess.run(
            bed.tools.exec_prefix(a.netns) + [sys.executable, "-c", _PING_PONG, *args, "ping"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
    finally:
        nb._stop(server)
    return float(out.split()[-1])


@pytest.mark.parametrize("queues", [1, 2])
def test_delay_line_holds_each_direction(tools: object, delay_line: str, queues: int) -> None:
    """A round trip over the delayed link takes both directions' delay more than over a veth
    pair, and bulk TCP still gets the shaped rate, with TAP interfaces of one queue and of
    several (flows spread over the queues by the kernel, a forwarding thread each)."""
    if delay_line:
        pytest.skip(delay_line)
    delay_us = 300.0
    with nb.Netbed(2, nb.parse_link(RATE)) as bed:
        plain = _round_trip_us(bed)
    with nb.Netbed(2, nb.parse_link(f"{RATE},{delay_us:g}us"), delay_queues=queues) as bed:
        tag = bed.plan.tag
        delayed = _round_trip_us(bed)
        gbps = bed.tcp_ceiling(streams=2, seconds=1.0)
        assert "delay line" in bed.plan.describe()
    assert delayed >= plain + 2 * delay_us * 0.97, (plain, delayed)
    assert delayed < plain + 2 * delay_us + 3000, (plain, delayed)  # a busy 2-core machine
    rate = nb.parse_link(RATE).rate_bps / 8 / 1e9
    assert 0.5 * rate < gbps < 1.02 * rate, (gbps, rate)
    assert _leftovers(tools, tag) == []
    print(
        f"\n[round trip {plain:.0f} us without delay, {delayed:.0f} us with {delay_us:g} us each way]"
    )


def test_teardown_after_a_failing_command_and_an_exception(tools: object, link: object) -> None:
    with nb.Netbed(2, link) as bed:
        tag = bed.plan.tag
        assert len(_leftovers(tools, tag)) == 2  # the namespaces; no link in the root namespace
        res = nb.launch(
            bed, [["sleep", "60"], ["sh", "-c", "exit 3"]], quiet=True, fail_grace_s=0.2
        )
    assert res.returncodes[1] == 3 and res.stopped == [True, False] and res.worst == 3
    assert res.seconds < 30
    assert _leftovers(tools, tag) == []
    with pytest.raises(RuntimeError, match="inside"):
        with nb.Netbed(2, link) as bed:
            tag = bed.plan.tag
            nb.launch(bed, [["sleep", "60"], ["sleep", "60"]], quiet=True, timeout=0.5)
            raise RuntimeError("inside")
    assert _leftovers(tools, tag) == []


def test_teardown_when_the_owner_is_killed(tools: object, link: object) -> None:
    """SIGKILL leaves no chance to tear down: the reaper does it."""
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); import netbed as nb\n"
        "bed = nb.Netbed(2, nb.parse_link(sys.argv[2])).__enter__()\n"
        "bed.popen(0, ['sleep', '60'], {})\n"
        "print(bed.plan.tag, flush=True); time.sleep(60)\n"
    )
    spec = f"{RATE},{link.delay_us:g}us"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(TOOL.parent), spec], stdout=subprocess.PIPE, text=True
    )
    tag = proc.stdout.readline().strip()
    assert tag and len(_leftovers(tools, tag)) == 2
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 20
    while _leftovers(tools, tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _leftovers(tools, tag) == []


def test_command_line_tears_down_on_sigterm(tools: object) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(TOOL), "--rate", RATE, "--raw", "--", "sleep", "60"],
        stdout=subprocess.PIPE,
        text=True,
    )
    tag = None
    for line in proc.stdout:  # "netbed <tag>: 2 nodes, ...", then the node commands
        if line.startswith("netbed ") and tag is None:
            tag = line.split()[1].rstrip(":")
        if line.startswith("node 1:"):
            break
    assert tag
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert _leftovers(tools, tag) == []


def test_stale_namespaces_of_dead_owners_are_removed(tools: object) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    alive = subprocess.Popen(["sleep", "30"])
    stale, kept = f"netbed-{dead.pid}-dead-n0", f"netbed-{alive.pid}-beef-n0"
    try:
        for ns in (stale, kept):
            tools.run(["ip", "netns", "add", ns])
        removed = nb.clean_stale(tools)
        names = nb.list_namespaces(tools)
        assert stale in removed and stale not in names
        assert kept in names and kept not in removed
    finally:
        alive.kill()
        alive.wait()
        nb.remove_namespaces(tools, [stale, kept])
