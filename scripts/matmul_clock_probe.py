#!/usr/bin/env python
"""SM clock and power while one fused-linear configuration runs back to back (one GPU).

Asks whether an epilogue's activation math slows the main loop through the power limit: for each
configuration (FASTCOMM_MATMUL_EPI value x activation, and cuBLAS's addmm_activation / matmul)
the op runs for --seconds while ``nvidia-smi`` samples the SM clock and the board power every
100 ms (reading only: no clock, power or mode is set). Prints per configuration the time per call
and the mean clock and power over the middle of its window, and writes --json.

    python scripts/matmul_clock_probe.py --size 8192 --seconds 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

CONFIGS = [
    ("offload", "none"),
    ("offload", "gelu_tanh"),
    ("tma2", "none"),
    ("tma2", "gelu_tanh"),
    ("cublas", "none"),
    ("cublas", "gelu_tanh"),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size", type=int, default=8192, help="M = N = K")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--json")
    args = p.parse_args()
    import torchext  # noqa: F401  (registers torch.ops.fastcomm)

    n = args.size
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, n, device="cuda", dtype=torch.bfloat16) / n**0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    smi = subprocess.Popen(
        [
            "nvidia-smi",
            "-i",
            str(torch.cuda.current_device()),
            "--query-gpu=timestamp,clocks.sm,power.draw",
            "--format=csv,noheader,nounits",
            "-lms",
            "100",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    windows = []
    try:
        for epi, act in CONFIGS:
            if epi == "cublas":
                if act == "none":
                    fn = lambda: torch.matmul(x, w.t())  # noqa: E731
                else:
                    fn = lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True)  # noqa: E731
            else:
                os.environ["FASTCOMM_MATMUL_EPI"] = epi
                fn = lambda act=act: torch.ops.fastcomm.linear(x, w, b, act)  # noqa: E731
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.time()
            calls = 0
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
            while time.time() - t0 < args.seconds:
                for _ in range(10):
                    fn()
                calls += 10
                torch.cuda.synchronize()
            ev1.record()
            ev1.synchronize()
            windows.append(
                {
                    "epi": epi,
                    "act": act,
                    "t0": t0,
                    "t1": time.time(),
                    "ms_per_call": ev0.elapsed_time(ev1) / calls,
                }
            )
            os.environ.pop("FASTCOMM_MATMUL_EPI", None)
            time.sleep(0.5)
    finally:
        time.sleep(0.3)
        smi.terminate()
        out, _ = smi.communicate()
    samples = []
    for line in out.splitlines():
        parts = [s.strip() for s in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            ts = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            frac = float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
            samples.append((ts + frac, float(parts[1]), float(parts[2])))
        except ValueError:
            continue
    print(f"{'epilogue':10s} {'act':10s} {'ms/call':>8s} {'SM MHz':>7s} {'W':>6s} samples")
    for win in windows:
        span = win["t1"] - win["t0"]
        lo, hi = win["t0"] + 0.25 * span, win["t1"] - 0.25 * span
        inside = [s for s in samples if lo <= s[0] <= hi]
        win["sm_mhz"] = statistics.mean(s[1] for s in inside) if inside else None
        win["power_w"] = statistics.mean(s[2] for s in inside) if inside else None
        win["samples"] = len(inside)
        mhz = f"{win['sm_mhz']:.0f}" if inside else "-"
        watts = f"{win['power_w']:.0f}" if inside else "-"
        print(
            f"{win['epi']:10s} {win['act']:10s} {win['ms_per_call']:8.3f} {mhz:>7s} "
            f"{watts:>6s} {len(inside)}"
        )
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "size": n}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "windows": windows}, f, indent=1)


if __name__ == "__main__":
    main()
