"""Modules built on fastcomm's fused operators."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor, nn

from torchext import ops

__all__ = ["FusedLinear"]


class FusedLinear(nn.Module):
    """Drop-in for ``nn.Linear`` followed by an activation, as one fused op.

    ``FusedLinear(i, o, activation="gelu")(x)`` computes
    ``F.gelu(F.linear(x, weight, bias))`` through ``torch.ops.fastcomm.linear``:
    bias and activation are applied in the matmul's epilogue. Parameters,
    their shapes (``weight`` is ``[out_features, in_features]``), their
    initialisation and the state-dict keys are those of ``nn.Linear``, so
    weights load either way.

    Args:
        in_features: size of each input sample.
        out_features: size of each output sample.
        bias: learn an additive bias (default True).
        activation: ``"none"``, ``"relu"``, ``"gelu"``, ``"gelu_tanh"`` or ``"silu"``.
        device, dtype: factory arguments for the parameters.
    """

    __constants__ = ["in_features", "out_features", "activation"]
    in_features: int
    out_features: int
    activation: str
    weight: Tensor
    bias: Optional[Tensor]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str = "none",
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        if activation not in ops.ACTIVATIONS:
            raise ValueError(f"activation must be one of {ops.ACTIVATIONS}, got {activation!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.activation = activation
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory_kwargs))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory_kwargs))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The initialisation of ``nn.Linear``."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = nn.init._calculate_fan_in_and_fan_out(self.weight)
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x, self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, activation={self.activation!r}"
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation: str = "none") -> "FusedLinear":
        """A FusedLinear that shares ``linear``'s parameters."""
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        if activation not in ops.ACTIVATIONS:
            raise ValueError(f"activation must be one of {ops.ACTIVATIONS}, got {activation!r}")
        mod.in_features = linear.in_features
        mod.out_features = linear.out_features
        mod.activation = activation
        mod.weight = linear.weight
        if linear.bias is not None:
            mod.bias = linear.bias
        else:
            mod.register_parameter("bias", None)
        return mod
