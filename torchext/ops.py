"""Fused tiled-matmul operators: ``torch.ops.fastcomm.matmul`` and ``torch.ops.fastcomm.linear``.

The operators are defined schema-first in C++ (``csrc/ops/matmul_schema.cpp``)
with CPU and CUDA kernels and their autograd (``csrc/ops/matmul_autograd.cpp``:
a formula registered from Python would cost a small-batch training step more
host time than its kernels take); the backward runs on the same kernels
(``dX = dY' @ W``, ``dW = dY'^T @ X``, ``dbias = sum(dY')``,
``dY' = dY * act'(pre-activation)``). This module adds, in the style of
pytorch/extension-cpp:

* fake (meta) kernels through :func:`torch.library.register_fake`, so that the
  ops trace under ``torch.compile`` / ``torch.export`` and run on FakeTensors;
* typed Python wrappers :func:`matmul` and :func:`linear`; where autograd will
  need the pre-activation (gelu, gelu_tanh, silu with an input that requires
  grad), :func:`linear` keeps it for the backward instead of the op's
  backward recomputing it with a fourth matmul.

The C++ library declares ``torchext.ops`` as the home of its fake kernels
(``m.set_python_module``), so torch imports this module on demand.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from torchext import _C  # noqa: F401  (loads the library that defines torch.ops.fastcomm)

__all__ = ["ACTIVATIONS", "matmul", "linear"]

#: Activations that :func:`linear` fuses into the matmul epilogue.
ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# The activations whose derivative needs the pre-activation (relu's is read off
# the output), as torch's own functions of it.
_PRE_ACTIVATION_GRAD: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
}


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` on fastcomm's tiled kernels.

    Args:
        a: ``[..., M, K]`` (at least 2-D; leading dimensions are batch).
        b: ``[K, N]``.

    Both float32, float16 or bfloat16 (float64 also works), on the same device;
    any strides (transposed or sliced inputs are handled, or copied where a
    kernel needs it). Half types accumulate in float32.

    Returns:
        ``[..., M, N]``, contiguous, dtype of the inputs.
    """
    return torch.ops.fastcomm.matmul.default(a, b)


def linear(
    x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: str = "none"
) -> Tensor:
    """``activation(x @ weight.T + bias)`` with bias and activation fused into the matmul.

    Args:
        x: ``[..., in_features]``.
        weight: ``[out_features, in_features]``, as for :func:`torch.nn.functional.linear`.
        bias: ``[out_features]`` or None.
        activation: one of ``"none"``, ``"relu"``, ``"gelu"`` (erf),
            ``"gelu_tanh"`` (tanh approximation), ``"silu"``.

    Returns:
        ``[..., out_features]``, contiguous, dtype of ``x``.

    Under autograd with gelu, gelu_tanh or silu (grad enabled and an input that
    requires grad) the product with its bias runs on its own and torch's
    activation follows, which keeps the pre-activation for the backward as
    ``F.gelu(F.linear(...))`` does: the backward then takes two matmuls (dX,
    dW) instead of three (the fused op's backward recomputes the
    pre-activation), for an output-sized tensor kept alive between forward and
    backward. Without autograd, and for relu, the activation stays fused.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    act = _PRE_ACTIVATION_GRAD.get(activation)
    if act is not None and _needs_grad(x, weight, bias):
        return act(torch.ops.fastcomm.linear.default(x, weight, bias, "none"))
    return torch.ops.fastcomm.linear.default(x, weight, bias, activation)


def _needs_grad(*tensors: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# --------------------------------------------------------------------------
# Fake kernels: output metadata only (shape, dtype, device; always contiguous).
# --------------------------------------------------------------------------


def _check_dtype(op: str, name: str, t: Tensor) -> None:
    torch._check(
        t.dtype in _DTYPES,
        lambda: (
            f"fastcomm.{op}: {name} has dtype {t.dtype}; supported dtypes are "
            "float32, float16, bfloat16 (and float64)"
        ),
    )


@torch.library.register_fake("fastcomm::matmul")
def _matmul_fake(a: Tensor, b: Tensor) -> Tensor:
    torch._check(a.dim() >= 2, lambda: f"fastcomm.matmul: a must be at least 2-D, got {a.dim()}-D")
    torch._check(b.dim() == 2, lambda: f"fastcomm.matmul: b must be 2-D [K, N], got {b.dim()}-D")
    _check_dtype("matmul", "a", a)
    torch._check(
        a.dtype == b.dtype, lambda: f"fastcomm.matmul: dtypes differ ({a.dtype}, {b.dtype})"
    )
    torch._check(a.device == b.device, lambda: "fastcomm.matmul: a and b are on different devices")
    torch._check(
        a.shape[-1] == b.shape[0],
        lambda: (
            f"fastcomm.matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied"
        ),
    )
    return a.new_empty((*a.shape[:-1], b.shape[1]))


@torch.library.register_fake("fastcomm::linear")
def _linear_fake(
    x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: str = "none"
) -> Tensor:
    torch._check(x.dim() >= 1, lambda: "fastcomm.linear: x must be at least 1-D")
    torch._check(weight.dim() == 2, lambda: "fastcomm.linear: weight must be 2-D [out, in]")
    _check_dtype("linear", "x", x)
    torch._check(x.dtype == weight.dtype, lambda: "fastcomm.linear: x and weight dtypes differ")
    torch._check(x.device == weight.device, lambda: "fastcomm.linear: x and weight devices differ")
    torch._check(
        x.shape[-1] == weight.shape[1],
        lambda: (
            f"fastcomm.linear: x has {x.shape[-1]} features but weight expects {weight.shape[1]}"
        ),
    )
    if bias is not None:
        torch._check(
            bias.dim() == 1 and bias.shape[0] == weight.shape[0],
            lambda: "fastcomm.linear: bias must be 1-D of size out_features",
        )
        torch._check(bias.dtype == x.dtype, lambda: "fastcomm.linear: bias dtype differs from x")
    torch._check(
        activation in ACTIVATIONS, lambda: f"fastcomm.linear: unknown activation {activation!r}"
    )
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
