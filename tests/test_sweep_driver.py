"""benchmarks/run_multinode_sweep.py: the launches it plans and the series it merges, one real
sweep of CPU tensors on 2 simulated nodes with fastcomm's own settings compared, and one stopped
by SIGTERM mid-launch."""

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
DRIVER = ROOT / "benchmarks" / "run_multinode_sweep.py"


sweep = load_benchmark_module("run_multinode_sweep")


def test_fastcomm_settings_become_launches_of_their_own(tmp_path: Path) -> None:
    args = sweep.parse_args(
        [
            "--device=cpu",
            "--nproc-per-node=2",
            "--sim-nodes=2",
            "--peer=gloo",
            "--socket-settings=1x1",
            "--buffsizes=default",
            "--wire-dtype=bf16",
            "--fastcomm-env=FASTCOMM_TCP_SOCKETS=2 FASTCOMM_CHUNK_BYTES=1M;FASTCOMM_TCP_SOCKETS=4;"
            "NCCL_MIN_NCHANNELS=8",
        ]
    )
    launches = sweep.plan_launches(args, str(tmp_path))
    variants = [la for la in launches if la.role == "variant"]
    assert [la.series for la in variants] == [
        "fastcomm(TCP_SOCKETS=2 CHUNK_BYTES=1M)",
        "fastcomm(TCP_SOCKETS=4)",
        "fastcomm(NCCL_MIN_NCHANNELS=8)",
    ]
    assert sweep.launch_env(variants[2])["NCCL_MIN_NCHANNELS"] == "8"
    assert variants[0].env == {"FASTCOMM_TCP_SOCKETS": "2", "FASTCOMM_CHUNK_BYTES": "1M"}
    assert all(la.backends == ["fastcomm"] for la in variants)
    assert sweep.launch_env(variants[1])["FASTCOMM_TCP_SOCKETS"] == "4"
    # The other launches do not carry the settings.
    others = [la for la in launches if la.role != "variant"]
    assert all("FASTCOMM_TCP_SOCKETS" not in la.env for la in others)
    assert [la.series for la in launches if la.role == "wire"] == ["fastcomm(bf16)"]


@pytest.mark.parametrize(
    "bad", ["TCP_SOCKETS=2", "FASTCOMM_TCP_SOCKETS", "FASTCOMM_X=", "GLOO_SOCKET_IFNAME=lo"]
)
def test_fastcomm_settings_must_be_fastcomm_or_nccl_assignments(bad: str) -> None:
    with pytest.raises(SystemExit):
        sweep.parse_args(["--device=cpu", "--nproc-per-node=2", f"--fastcomm-env={bad}"])


@pytest.mark.skipif(is_gloo(), reason="runs the fastcomm backend")
def test_a_sweep_merges_each_fastcomm_setting_as_a_series(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, str(DRIVER), "--device=cpu", "--nproc-per-node=2", "--sim-nodes=2"]
    cmd += ["--peer=gloo", "--socket-settings=1x1", "--buffsizes=default", "--min-bytes=4K"]
    cmd += ["--max-bytes=64K", "--factor=16", "--repeats=1", "--time-per-size=0.05"]
    cmd += ["--fastcomm-env=FASTCOMM_TCP_SOCKETS=1", "--launch-timeout=120"]
    cmd += ["--out-dir", str(tmp_path / "runs"), "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    merged = json.loads(out.read_text())
    series = merged["meta"]["backends"]
    assert "fastcomm(TCP_SOCKETS=1)" in series, series
    rows = [r for r in merged["results"] if r["backend"] == "fastcomm(TCP_SOCKETS=1)"]
    assert [r["size_bytes"] for r in rows] == [4096, 65536], rows
    assert all(r["status"] == "ok" and r["wrong"] == 0 for r in rows), rows
    launch = next(la for la in merged["meta"]["sweep"]["launches"] if la["name"] == "fastcomm-env0")
    assert launch["env"]["FASTCOMM_TCP_SOCKETS"] == "1" and launch["series"] == rows[0]["backend"]


def _processes_naming(text: str) -> list[int]:
    """The pids whose command line contains `text`."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


@pytest.mark.skipif(is_gloo(), reason="runs the fastcomm backend")
def test_a_stopped_sweep_keeps_the_points_measured_so_far(tmp_path: Path) -> None:
    out, md, runs = tmp_path / "sweep.json", tmp_path / "sweep.md", tmp_path / "runs"
    cmd = [sys.executable, str(DRIVER), "--device=cpu", "--nproc-per-node=2", "--sim-nodes=2"]
    cmd += ["--peer=gloo", "--socket-settings=1x1", "--buffsizes=default", "--min-bytes=4K"]
    cmd += ["--max-bytes=256M", "--factor=4", "--repeats=1", "--time-per-size=0.5"]
    cmd += ["--launch-timeout=300", "--out-dir", str(runs), "--json", str(out), "--md", str(md)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = tmp_path / "driver.log"
    with open(log, "w") as sink:  # a file, not a pipe: nobody reads while the launch runs
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
        # The main launch's result file grows a point at a time; stop the sweep after the first.
        partial, first = runs / "main.json", {"results": []}
        deadline = time.monotonic() + 240
        while not first["results"] and proc.poll() is None and time.monotonic() < deadline:
            if partial.exists():
                first = json.loads(partial.read_text())
            time.sleep(0.2)
        assert first["results"], "no point written before the launch ended"
        assert first["meta"]["partial"] is True
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    output = log.read_text()
    assert proc.returncode == 1, output[-3000:]
    assert "stopped by SIGTERM" in output, output[-3000:]
    merged = json.loads(out.read_text())
    assert merged["meta"]["interrupted"] is True
    main = next(la for la in merged["meta"]["sweep"]["launches"] if la["name"] == "main")
    assert main["loaded"] and main["partial"], main
    measured = [r for r in merged["results"] if r["backend"] == "fastcomm"]
    assert 1 <= len(measured) < 9, measured  # 4 KiB .. 256 MiB is 9 sizes
    assert all(r["status"] == "ok" and r["wrong"] == 0 for r in measured), measured
    assert "Interrupted" in md.read_text()
    # The stopped launch's ranks and torchrun are gone.
    deadline = time.monotonic() + 30
    while _processes_naming(str(partial)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _processes_naming(str(partial))
