#!/usr/bin/env python
"""Accuracy of the lean activations of the Hopper "tma2" epilogue
(activate_lean in kernels/matmul_device.cuh), on the CPU.

Emulates the float32 arithmetic of the device code (fmaf through float64 and
one rounding, the integer first guess of rcp_soft bit for bit) with the
hardware ex2 / rcp either exact or off by their PTX error bounds (ex2.approx
2^-22 relative, rcp.approx 1 ulp; both signs), and prints the largest error
against float64 references over a dense grid of [-20, 20], absolute and
relative to max(|y|, 1). Used for the numbers in the comment above
activate_lean; needs only numpy.

    python scripts/check_lean_act.py
"""

from __future__ import annotations

import math

import numpy as np

f32 = np.float32


def fma(a, b, c):
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(f32)


def ex2(x, err):
    return (np.exp2(x.astype(np.float64)) * (1 + err)).astype(f32)


def rcp(x, err):
    return (1.0 / x.astype(np.float64) * (1 + err)).astype(f32)


def rcp_soft(d):
    d = np.minimum(d, f32(2.0**126))
    r = (np.int32(0x7EF311C3) - d.view(np.int32)).view(f32)
    for _ in range(3):
        r = fma(r, fma(-d, r, f32(1)), r)
    return r


def gelu_lean(x, e_ex2, e_rcp):
    t = rcp(fma(f32(0.2316418883), np.abs(x), f32(1)), e_rcp)
    q = fma(f32(0.5307027145), t, f32(-0.7265760135))
    q = fma(q, t, f32(0.7107068705))
    q = fma(q, t, f32(-0.142248368))
    q = fma(q, t, f32(0.127414796))
    e = ex2((x * x) * f32(-0.72134752044448170), e_ex2)
    h = (q * t) * e
    return x * np.where(x >= 0, f32(1) - h, h)


def sig_lean(x, arg, soft, e_ex2, e_rcp):
    with np.errstate(over="ignore"):
        d = f32(1) + ex2(arg, e_ex2)
    return x * (rcp_soft(d) if soft else rcp(d, e_rcp))


def gelu_tanh_lean(x, soft, e_ex2, e_rcp):
    a = f32(-2.3022081983)
    b = f32(a * f32(0.044715))
    return sig_lean(x, x * fma(b, x * x, a), soft, e_ex2, e_rcp)


def silu_lean(x, soft, e_ex2, e_rcp):
    return sig_lean(x, x * f32(-1.4426950408889634), soft, e_ex2, e_rcp)


def main() -> None:
    x = np.linspace(-20, 20, 4_000_001, dtype=np.float64).astype(f32)
    xd = x.astype(np.float64)
    erf = np.vectorize(math.erf)
    ref = {
        "gelu": 0.5 * xd * (1 + erf(xd / math.sqrt(2))),
        "gelu_tanh": 0.5 * xd * (1 + np.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd**3))),
        "silu": xd / (1 + np.exp(-xd)),
    }
    for name in ref:
        worst_abs = worst_rel = 0.0
        for e_ex2 in (0.0, 2.0**-22, -(2.0**-22)):
            for e_rcp in (0.0, 2.0**-23, -(2.0**-23)):
                for soft in (False, True):
                    if name == "gelu":
                        if soft:
                            continue
                        y = gelu_lean(x, e_ex2, e_rcp)
                    elif name == "gelu_tanh":
                        y = gelu_tanh_lean(x, soft, e_ex2, e_rcp)
                    else:
                        y = silu_lean(x, soft, e_ex2, e_rcp)
                    err = np.abs(y.astype(np.float64) - ref[name])
                    assert np.isfinite(y).all(), name
                    worst_abs = max(worst_abs, float(err.max()))
                    worst_rel = max(
                        worst_rel, float((err / np.maximum(np.abs(ref[name]), 1.0)).max())
                    )
        print(f"{name:10s} max abs error {worst_abs:.2e}  max error / max(|y|, 1) {worst_rel:.2e}")


if __name__ == "__main__":
    main()
