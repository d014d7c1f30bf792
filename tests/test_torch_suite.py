"""PyTorch's own DistributedTest suite against fastcomm, on CPU (tests/torch_suite.py).

Every CPU test of the suite runs, 3 ranks each, with the ranks forked from two workers: about a
minute on two cores. (The same run with freshly spawned ranks, as PyTorch runs the suite, is
``python tests/torch_suite.py --device cpu``; the CUDA run needs the GPU machines.) No test may
fail, and each of torch_suite.CORE_TESTS, which together cover every collective API, must pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch_suite
from _harness import BACKEND

pytestmark = pytest.mark.skipif(
    BACKEND != "fastcomm", reason="the suite is pointed at fastcomm only"
)


def run_suite(tmp_path: Path, *args: str, timeout: float) -> tuple[int, str, dict[str, Any]]:
    """Runs the runner on CPU with forked ranks and `args`: its exit status, the tail of its
    output, and its JSON summary."""
    summary_path = tmp_path / "summary.json"
    cmd = [
        sys.executable,
        os.path.abspath(torch_suite.__file__),
        "--device", "cpu",
        "--start", "fork",
        "--json", str(summary_path),
        *args,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout, check=False
    )
    output = (proc.stdout + proc.stderr)[-6000:]
    assert summary_path.exists(), f"the runner wrote no summary (exit {proc.returncode}):\n{output}"
    return proc.returncode, output, json.loads(summary_path.read_text())


def test_distributed_suite_cpu(tmp_path: Path) -> None:
    code, output, summary = run_suite(tmp_path, "--jobs", "2", "--timeout", "120", timeout=1200)
    status = {t["test"]: t for t in summary["tests"]}

    failed = [f"{name}: {t['reason']}" for name, t in status.items() if t["status"] == "failed"]
    assert not failed, "failed in PyTorch's DistributedTest:\n  " + "\n  ".join(failed)
    not_passed = [
        (
            f"{name}: {status[name]['status']} {status[name]['reason']}".rstrip()
            if name in status
            else f"{name}: not in this torch's suite"
        )
        for name in torch_suite.CORE_TESTS
        if status.get(name, {}).get("status") != "passed"
    ]
    assert not not_passed, "core tests that did not pass:\n  " + "\n  ".join(not_passed)
    assert code == 0, output


def test_stock_backend_runs_the_suite_unchanged(tmp_path: Path) -> None:
    """--stock runs the selected tests on gloo itself (the CPU stock backend), so a test that
    fails there too is told apart from a failure of fastcomm."""
    code, output, summary = run_suite(
        tmp_path, "--stock", "-k", "test_all_reduce_sum", "-k", "test_monitored_barrier_gloo",
        timeout=600,
    )  # fmt: skip
    assert code == 0, output
    assert summary["backend"] == "gloo", summary["backend"]
    status = {t["test"]: t["status"] for t in summary["tests"]}
    # gloo's own API runs here (it is not applicable to fastcomm)
    assert status.get("test_monitored_barrier_gloo") == "passed", status
    assert status.get("test_all_reduce_sum") == "passed", status
