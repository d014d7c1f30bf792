"""benchmarks/run_multinode_sweep.py: the launches it plans and the series it merges, and one
real sweep of CPU tensors on 2 simulated nodes with fastcomm's own settings compared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
