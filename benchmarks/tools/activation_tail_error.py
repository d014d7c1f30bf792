#!/usr/bin/env python
"""Element-wise error of fused bias + activation epilogues against float64, on CUDA.

Pre-activations from -8 to 8 (exact in the 16-bit type: one non-zero product per output), through
cuBLASLt's fused bias + GELU (`torch._addmm_activation`), torch's unfused `F.gelu(F.linear)` /
`F.silu(F.linear)` and, where torchext imports, fastcomm's `linear`; per dtype and activation the
largest error / max(|y|, 1) and the largest distance from the correctly rounded output in units
in the last place (all outputs, and those of pre-activations below -1: the tails where 1 + tanh
and 1 + erf cancel).

    python benchmarks/tools/activation_tail_error.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from torchext import ops
except ImportError as e:
    print("no torchext:", e)
    ops = None

dev = "cuda"
M, N, K = 8192, 256, 64
for dt in (torch.bfloat16, torch.float16):
    x = torch.linspace(-8, 8, M, device=dev).to(dt)  # pre-activations, exactly representable
    a = torch.zeros(M, K, device=dev, dtype=dt)
    a[:, 0] = x
    w = torch.zeros(N, K, device=dev, dtype=dt)
    w[:, 0] = 1
    bias = torch.zeros(N, device=dev, dtype=dt)
    v = x.double()[:, None].expand(M, N)
    refs = {
        "gelu_tanh": 0.5 * v * (1 + torch.tanh(0.7978845608028654 * (v + 0.044715 * v**3))),
        "gelu": 0.5 * v * torch.erfc(-v / 2**0.5),
        "silu": v / (1 + torch.exp(-v)),
    }
    outs = {
        ("gelu_tanh", "addmm_act"): lambda: torch._addmm_activation(bias, a, w.t(), use_gelu=True),
        ("gelu_tanh", "unfused"): lambda: F.gelu(F.linear(a, w, bias), approximate="tanh"),
        ("silu", "unfused"): lambda: F.silu(F.linear(a, w, bias)),
        ("gelu", "unfused"): lambda: F.gelu(F.linear(a, w, bias)),
    }
    if ops is not None:
        for act in ("gelu_tanh", "silu", "gelu"):
            outs[(act, "fastcomm")] = lambda act=act: ops.linear(a, w, bias, act)
    for (act, name), fn in outs.items():
        y = fn().double()
        ref = refs[act]
        rounded = ref.to(dt).double()
        err = (y - ref).abs()
        e1 = (err / ref.abs().clamp(min=1)).max().item()
        ulp_ref = (rounded - ref).abs()
        # error beyond the correctly-rounded output, in output ulps at the reference
        ulp = (
            torch.nextafter(
                rounded.abs().to(dt), torch.tensor(float("inf"), device=dev, dtype=dt)
            ).double()
            - rounded.abs()
        )
        ulps = ((y - rounded).abs() / ulp).max().item()
        neg = x.double() < -1
        ulps_neg = ((y - rounded).abs() / ulp)[neg].max().item()
        print(
            f"{dt} {act:9s} {name:9s} err/max(|y|,1) {e1:.3g} (rounding {((ulp_ref)/ref.abs().clamp(min=1)).max().item():.3g})"
            f"  max ulps off {ulps:.1f}  x<-1: {ulps_neg:.1f}"
        )
