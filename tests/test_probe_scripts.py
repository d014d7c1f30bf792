"""The probes beside the multi-node benchmarks. The CPU-pinning one (scripts/pin_local_rank.py):
local ranks get disjoint slices of whole physical cores that together cover every allowed CPU,
and the command it execs runs under that mask. The host-memory one (scripts/host_membw.py):
writes the benchmarks' JSON shape, with one positive rate per timed copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _harness import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "pin_local_rank.py"


@pytest.mark.parametrize(
    "ncores,smt,world", [(32, 2, 4), (8, 2, 3), (6, 1, 4), (2, 2, 4), (16, 4, 2)]
)
def test_slices_are_whole_cores_disjoint_and_complete(monkeypatch, ncores, smt, world):
    pin = load_script("pin_local_rank")
    # Linux numbers SMT siblings one core-count apart (cpu c and c + ncores).
    monkeypatch.setattr(pin, "core_of", lambda cpu: (0, cpu % ncores))
    cpus = set(range(ncores * smt))
    slices = [pin.slice_for(r, world, cpus) for r in range(world)]
    if ncores >= world:
        seen: set[int] = set()
        for s in slices:
            assert s, slices
            assert not seen & set(s), slices
            seen |= set(s)
            # Whole cores: every CPU's siblings are in the same slice.
            assert all((c % ncores) + k * ncores in s for c in s for k in range(smt))
        assert seen == cpus
        sizes = [len({c % ncores for c in s}) for s in slices]
        assert max(sizes) - min(sizes) <= 1, sizes
    else:
        # More ranks than cores: nobody is left without CPUs.
        assert all(set(s) for s in slices)


def test_bad_local_rank_is_refused():
    pin = load_script("pin_local_rank")
    with pytest.raises(ValueError, match="outside"):
        pin.slice_for(2, 2, {0, 1})


def test_compact_ranges():
    pin = load_script("pin_local_rank")
    assert pin.compact([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert pin.compact([3]) == "3"
    assert pin.compact([]) == ""


def test_execs_the_command_under_the_mask():
    allowed = sorted(os.sched_getaffinity(0))
    env = dict(os.environ, LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    out = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            sys.executable,
            "-c",
            "import os; print(sorted(os.sched_getaffinity(0)))",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert out.stdout.strip() == str(allowed)
    assert "local rank 0 of 1" in out.stderr


def test_host_membw_writes_benchmark_json(tmp_path):
    membw = load_script("host_membw")
    out = tmp_path / "membw.json"
    assert membw.main(["--mib", "8", "--threads", "1", "--iters", "3", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["backend"] == "host-copy" and row["bytes"] == 8 << 20
    assert len(row["samples_gbps"]) == 3 and all(r > 0 for r in row["samples_gbps"])
    assert min(row["samples_gbps"]) <= row["busbw_gbps"] <= max(row["samples_gbps"])


def test_host_membw_rejects_nonpositive_arguments():
    membw = load_script("host_membw")
    with pytest.raises(SystemExit):
        membw.main(["--iters", "0"])


def test_ncu_summary_raw_table(tmp_path):
    # The shape of `ncu --csv --page raw` with matmul_ncu.py's kernel lines mixed in.
    path = tmp_path / "ncu_raw.csv"
    path.write_text(
        "==PROF== Connected\n"
        '"ID","Kernel Name","smsp__inst_executed.sum","smsp__inst_executed.avg","dram__bytes_read.sum"\n'
        '"","","inst","inst","byte"\n'
        '"0","gemm","1,690,000","32000","148000000"\n'
        '"1","nvjet","26000000","49300","145000000"\n'
        "# kernel 0: 4096x4096x4096 fc[auto]\n"
        "# kernel 1: 4096x4096x4096 cublas\n"
    )
    table = load_script("ncu_summary").raw_table(str(path), ["smsp__inst_executed", "dram"])
    lines = table.splitlines()
    assert lines[2] == "| smsp__inst_executed.sum | 1.69e+06 | 2.6e+07 |"
    assert lines[3] == "| dram__bytes_read.sum | 1.48e+08 | 1.45e+08 |"
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
    summary = load_script("ncu_summary")
    names, counts = summary.opcode_counts(str(path))
    assert names == ["ours", "cublas"]
    assert [dict(c) for c in counts] == [{"HGMMA": 200, "BRA": 7}, {"HGMMA": 100, "BRA": 1}]
    lines = summary.opcode_table(str(path), top=5).splitlines()
    assert lines[0] == "| opcode | 0 | 1 |"
    assert lines[3].startswith("| HGMMA |")
    assert lines[-2:] == ["0: ours", "1: cublas"]
