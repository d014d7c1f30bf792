#!/usr/bin/env python
"""Tables from the Nsight Compute output of benchmarks/tools/matmul_ncu.sh (no torch needed).

* ``raw FILE``: the ``--page raw --csv`` output of matmul_ncu.sh (``ncu_raw.csv``):
  one row per metric, one column per profiled kernel, in the order of the
  ``# kernel i: ...`` lines matmul_ncu.py printed into the same file.
* ``opcodes FILE``: the ``--page source --csv --print-source sass`` export of a
  report taken with ``--section SourceCounters``: warp instructions executed per
  SASS opcode (predicates and modifiers dropped), one column per kernel.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import math
import re
import sys


def _float(value: str) -> float:
    try:
        return float(value.replace(",", ""))
    except ValueError:
        return float("nan")


def raw_table(path: str, prefixes: list[str]) -> str:
    with open(path) as f:
        lines = f.readlines()
    rows = list(csv.reader(io.StringIO("".join(ln for ln in lines if ln.startswith('"')))))
    header, data = rows[0], rows[2:]
    names = [ln.split(": ", 1)[1].strip() for ln in lines if ln.startswith("# kernel")]
    cycles = ("sm__cycles_elapsed.avg", "sm__cycles_elapsed.avg.per_second")
    wanted = [
        h
        for h in header
        if (h.endswith((".sum", ".ratio")) or h in cycles)
        and any(h.startswith(p) for p in prefixes)
    ]
    out = ["| metric | " + " | ".join(str(i) for i in range(len(data))) + " |"]
    out.append("|---" * (len(data) + 1) + "|")
    for h in wanted:
        i = header.index(h)
        out.append(f"| {h} | " + " | ".join(f"{_float(r[i]):.3g}" for r in data) + " |")
    out.append("")
    out += [f"{i}: {n}" for i, n in enumerate(names)]
    return "\n".join(out)


def opcode_counts(path: str) -> tuple[list[str], list[collections.Counter]]:
    """Kernel names and, per kernel, warp instructions executed per SASS opcode."""
    with open(path) as f:
        rows = list(csv.reader(f))
    kernels: list[dict] = []
    current = None
    for r in rows:
        if r and r[0] == "Kernel Name":
            current = {"name": r[1], "header": None, "rows": []}
            kernels.append(current)
        elif current is not None and r and r[0] == "Address":
            current["header"] = r
        elif current is not None and current["header"] is not None:
            current["rows"].append(r)
    counts: list[collections.Counter] = []
    names: list[str] = []
    for k in kernels:
        h = k["header"]
        col, src = h.index("Instructions Executed"), h.index("Source")
        c: collections.Counter = collections.Counter()
        for r in k["rows"]:
            n = _float(r[col]) if len(r) > col else float("nan")
            if math.isnan(n):  # not an instruction row
                continue
            text = re.sub(r"^@!?U?P\w+\s+", "", r[src].strip())
            c[text.split()[0].split(".")[0] if text else "?"] += n
        # ncu 2025.3's export repeats some kernels (same name, same counts): keep one.
        if counts and c == counts[-1] and k["name"] == names[-1]:
            continue
        counts.append(c)
        names.append(k["name"])
    return names, counts


def opcode_table(path: str, top: int) -> str:
    names, counts = opcode_counts(path)
    ops = sorted(set().union(*counts), key=lambda o: -max(c[o] for c in counts))[:top]
    out = ["| opcode | " + " | ".join(str(i) for i in range(len(counts))) + " |"]
    out.append("|---" * (len(counts) + 1) + "|")
    out.append("| all | " + " | ".join(f"{sum(c.values()) / 1e6:.2f}M" for c in counts) + " |")
    for op in ops:
        out.append(f"| {op} | " + " | ".join(f"{c[op] / 1e6:.3f}M" for c in counts) + " |")
    out.append("")
    out += [f"{i}: {n[:120]}" for i, n in enumerate(names)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("raw", help="metric table of ncu_raw.csv")
    r.add_argument("file")
    r.add_argument(
        "--prefix",
        default="gpu__time,sm__cycles_elapsed,smsp__inst_executed,sm__inst_executed,"
        "l1tex__data_bank,lts__t_bytes,dram__bytes,smsp__average_warps_issue_stalled",
        help="comma list of metric-name prefixes to show",
    )
    o = sub.add_parser("opcodes", help="instructions per SASS opcode of a source export")
    o.add_argument("file")
    o.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    if args.mode == "raw":
        print(raw_table(args.file, args.prefix.split(",")))
    else:
        print(opcode_table(args.file, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
