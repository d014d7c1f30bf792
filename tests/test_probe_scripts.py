"""The maintained tools beside the benchmarks (benchmarks/tools/) and the GPU-machine runner
(scripts/gpu_check.sh): the Nsight Compute summary reads ncu's CSV shapes, and the shell scripts
parse and name every stage they handle."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from _harness import load_benchmark_module

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "benchmarks" / "tools"
RUNNER = ROOT / "scripts" / "gpu_check.sh"


@pytest.mark.parametrize("script", [RUNNER, TOOLS / "matmul_ncu.sh"], ids=lambda p: p.name)
def test_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)


def test_runner_documents_every_stage_it_handles():
    text = RUNNER.read_text()
    handled = set(re.findall(r"^    ([a-z]+)\)$", text, flags=re.M))
    documented = set(re.findall(r"^#   ([a-z]+) ", text, flags=re.M))
    assert handled == documented, (handled, documented)
    expected = {"build", "carried", "tests", "ops", "bench", "sweep", "matmulbench", "killed"}
    assert (
        expected
        | {"capture", "hier", "hooks", "ddpbench", "suite", "netbed", "netbedcpu", "nvlink"}
        | {"nvlinkparts", "matmulgrid"}
        == handled
    )


def test_runner_unknown_stage_fails_before_running_anything(tmp_path):
    # The stage check runs after the interpreter query: give it a python that answers 0 GPUs.
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho 0\n")
    fake.chmod(0o755)
    out = subprocess.run(
        ["bash", str(RUNNER), "nosuchstage"],
        env={"PATH": "/usr/bin:/bin", "FASTCOMM_PYTHON": str(fake), "OUT": str(tmp_path / "out")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "unknown stage nosuchstage" in out.stderr


def test_matmul_split_sweep_setting_names():
    # The forced configurations the sweep's setting names stand for, and the names it refuses.
    sweep = load_benchmark_module("tools/matmul_split_sweep")
    assert sweep.parse_setting("auto") == {}
    assert sweep.parse_setting("rows_s8") == {"impl": "mma", "tile": "narrow", "splits": "8"}
    assert sweep.parse_setting("coop128_s1") == {
        "impl": "wgmma",
        "sched": "coop",
        "tile": "small",
        "splits": "1",
    }
    assert sweep.parse_setting("coop256tma")["epi"] == "tma"
    for bad in ("auto_s2", "rows_sx", "coop512", ""):
        with pytest.raises(ValueError, match="unknown setting"):
            sweep.parse_setting(bad)


def test_ncu_summary_raw_table(tmp_path):
    # The shape of `ncu --csv --page raw` with matmul_ncu.py's kernel lines mixed in.
    path = tmp_path / "ncu_raw.csv"
    path.write_text(
        "==PROF== Connected\n"
        '"ID","Kernel Name","smsp__inst_executed.sum","smsp__inst_executed.avg",'
        '"dram__bytes_read.sum","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"\n'
        '"","","inst","inst","byte","ratio"\n'
        '"0","gemm","1,690,000","32000","148000000","0.25"\n'
        '"1","nvjet","26000000","49300","145000000","0.5"\n'
        "# kernel 0: 4096x4096x4096 fc[auto]\n"
        "# kernel 1: 4096x4096x4096 cublas\n"
    )
    table = load_benchmark_module("tools/ncu_summary").raw_table(
        str(path), ["smsp__inst_executed", "dram", "smsp__average_warps_issue_stalled"]
    )
    lines = table.splitlines()
    assert lines[2] == "| smsp__inst_executed.sum | 1.69e+06 | 2.6e+07 |"
    assert lines[3] == "| dram__bytes_read.sum | 1.48e+08 | 1.45e+08 |"
    stall = "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"
    assert lines[4] == f"| {stall} | 0.25 | 0.5 |"  # stall reasons per issue
    assert not any(".avg" in ln for ln in lines)  # per-unit averages left out
    assert lines[-2:] == ["0: 4096x4096x4096 fc[auto]", "1: 4096x4096x4096 cublas"]


def test_ncu_summary_opcode_table(tmp_path):
    # The shape of `ncu --page source --csv --print-source sass`: one block per kernel; the
    # export repeats some kernels, which the table counts once.
    block = (
        '"Kernel Name","{name}"\n'
        '"Address","Source","Instructions Executed"\n'
        '"0x10","HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8], R24","{h}"\n'
        '"0x20","@!P0  BRA 0x10","{b}"\n'
        '"0x30","@P1 HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8], R24","{h}"\n'
        '"0x40","","",\n'
    )
    path = tmp_path / "src.csv"
    path.write_text(
        block.format(name="ours", h=100, b=7)
        + block.format(name="ours", h=100, b=7)
        + block.format(name="cublas", h=50, b=1)
    )
    summary = load_benchmark_module("tools/ncu_summary")
    names, counts = summary.opcode_counts(str(path))
    assert names == ["ours", "cublas"]
    assert [dict(c) for c in counts] == [{"HGMMA": 200, "BRA": 7}, {"HGMMA": 100, "BRA": 1}]
    lines = summary.opcode_table(str(path), top=5).splitlines()
    assert lines[0] == "| opcode | 0 | 1 |"
    assert lines[3].startswith("| HGMMA |")
    assert lines[-2:] == ["0: ours", "1: cublas"]


def test_matmul_grid_plot_ratios_and_order(tmp_path):
    # Two halves of one dtype's grid merge; each op is timed against its own baseline; failed
    # points and other methods stay out; squares come after the (N, K) groups.
    def result(m, n, k, op, method, ms, ok=True):
        return {"M": m, "N": n, "K": k, "op": op, "method": method, "ms": ms, "ok": ok}

    small = tmp_path / "small.json"
    small.write_text(
        json.dumps(
            {
                "meta": {"device": "H100"},
                "results": [
                    result(1, 4096, 4096, "matmul", "cublas", 2.0),
                    result(1, 4096, 4096, "matmul", "fastcomm[auto]", 1.0),
                    result(1, 4096, 4096, "matmul", "fastcomm[whole_tiles]", 4.0),
                    result(1, 4096, 4096, "linear_gelu", "addmm_activation", 3.0),
                    result(1, 4096, 4096, "linear_gelu", "fastcomm[auto]", 4.0),
                ],
            }
        )
    )
    mid = tmp_path / "mid.json"
    mid.write_text(
        json.dumps(
            {
                "results": [
                    result(1024, 1024, 1024, "matmul", "cublas", 1.0),
                    result(1024, 1024, 1024, "matmul", "fastcomm[auto]", 2.0),
                    result(512, 4096, 4096, "matmul", "cublas", 1.0),
                    result(512, 4096, 4096, "matmul", "fastcomm[auto]", 0.5, ok=False),
                    result(8, 11008, 4096, "matmul", "cublas", 1.0),
                    result(8, 11008, 4096, "matmul", "fastcomm[auto]", 1.0),
                ]
            }
        )
    )
    plot = load_benchmark_module("tools/matmul_grid_plot")
    by_op, device = plot.ratios([str(small), str(mid)], "fastcomm[auto]")
    assert device == "H100"
    assert by_op["matmul"] == {(1, 4096, 4096): 2.0, (1024, 1024, 1024): 0.5, (8, 11008, 4096): 1.0}
    assert by_op["linear_gelu"] == {(1, 4096, 4096): 0.75}
    shapes = {(1024, 1024, 1024), (8, 11008, 4096), (1, 4096, 4096), (256, 4096, 4096)}
    assert plot.shape_order(shapes) == [
        (1, 4096, 4096),
        (256, 4096, 4096),
        (8, 11008, 4096),
        (1024, 1024, 1024),
    ]
