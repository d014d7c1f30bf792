"""Tests of torch.ops.fastcomm.matmul / linear, torchext.ops and torchext.nn.FusedLinear.

CPU tests run in CI; the same tests run on CUDA when a GPU is present
(marked ``cuda``), plus CUDA-only tests of each kernel path and of the Hopper
wgmma kernel (sm_90 only), forced through torchext._testing.set_matmul_config
(the FASTCOMM_MATMUL_* environment is read once per process).

Accuracy is judged by ||out - ref|| / ||ref|| against a float64 reference
computed from the same (rounded) inputs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

import torchext  # noqa: F401  (loads the extension and registers the ops)
from torchext import ops
from torchext.nn import FusedLinear

HAS_CUDA = torch.cuda.is_available()
_skip_no_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda(1), _skip_no_cuda])]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ACTS = ["none", "relu", "gelu", "gelu_tanh", "silu"]

# Bounds on the relative Frobenius error against float64.
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2, torch.float64: 1e-12}

# (M, N, K): odd sizes, sizes below/above one tile, K not a multiple of 8.
SHAPES = [(1, 1, 1), (7, 13, 5), (33, 65, 17), (64, 128, 96), (129, 257, 200)]
# Larger shapes exercised on CUDA only (several tiles, several pipeline stages).
CUDA_SHAPES = [(300, 520, 1000), (1024, 768, 512), (17, 1000, 4096)]


def _ref_act(t: torch.Tensor, act: str) -> torch.Tensor:
    if act == "none":
        return t
    if act == "relu":
        return F.relu(t)
    if act == "gelu":
        return F.gelu(t)
    if act == "gelu_tanh":
        return F.gelu(t, approximate="tanh")
    if act == "silu":
        return F.silu(t)
    raise ValueError(act)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    ref = ref.double()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "non-finite values in the output"
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num / den if den > 0 else num


def _poison_cuda_cache(device: str) -> None:
    """Leave NaN-filled blocks in the caching allocator, so that an output
    element the kernel fails to write shows up as NaN."""
    if device == "cuda":
        bufs = [
            torch.full((n,), float("nan"), device=device)
            for n in (1 << 12, 1 << 16, 1 << 20, 1 << 23)
        ]
        del bufs


def _rand(*shape, dtype, device, gen=None):
    return torch.randn(*shape, dtype=torch.float32, device="cpu", generator=gen).to(
        dtype=dtype, device=device
    )


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


# ---------------------------------------------------------------- numerics


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matmul_matches_float64(device, dtype, shape):
    m, n, k = shape
    a = _rand(m, k, dtype=dtype, device=device)
    b = _rand(k, n, dtype=dtype, device=device)
    _poison_cuda_cache(device)
    out = ops.matmul(a, b)
    assert out.dtype == dtype and out.device == a.device and out.shape == (m, n)
    assert out.is_contiguous()
    assert _rel_err(out, a.double() @ b.double()) < RTOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_matches_float64(device, dtype, act, with_bias):
    for m, n, k in [(7, 13, 5), (129, 257, 200)]:
        x = _rand(m, k, dtype=dtype, device=device)
        w = _rand(n, k, dtype=dtype, device=device)
        b = _rand(n, dtype=dtype, device=device) if with_bias else None
        _poison_cuda_cache(device)
        out = ops.linear(x, w, b, act)
        pre = x.double() @ w.double().t()
        if b is not None:
            pre = pre + b.double()
        assert out.dtype == dtype and out.shape == (m, n)
        assert _rel_err(out, _ref_act(pre, act)) < RTOL[dtype], (m, n, k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu"])
def test_activation_negative_tail_elementwise(device, dtype, act):
    """Every output of the smooth activations close to float64, element by element, down the
    negative tail (x = -1 .. -5), where 1 + erf(x / sqrt 2) and 1 + tanh(u) cancel: computed
    that way, float32 gelu is off by up to 4% relative there and gelu_tanh by up to 30%."""
    x = -torch.linspace(1.0, 5.0, 161, dtype=torch.float64)
    # K = 1 and weight 1: the pre-activation is the input exactly.
    x_in = x.to(dtype).reshape(-1, 1).to(device)
    w = torch.ones(1, 1, dtype=dtype, device=device)
    y = ops.linear(x_in, w, None, act).double().cpu().reshape(-1)
    v = x_in.double().cpu().reshape(-1)
    # Tail-accurate float64 references (F.gelu's 1 + erf cancels in float64 as well).
    ref = _tail_accurate_ref(v, act)
    rel = ((y - ref).abs() / ref.abs()).max().item()
    assert rel < RTOL[dtype], (act, rel)


def _tail_accurate_ref(v: torch.Tensor, act: str) -> torch.Tensor:
    """float64 references without the 1 + erf / 1 + tanh cancellation of the negative tail."""
    if act == "gelu":
        return 0.5 * v * torch.special.erfc(-v / math.sqrt(2.0))
    if act == "gelu_tanh":
        return v * torch.sigmoid(2.0 * math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3))
    return v * torch.sigmoid(v)


# The 16-bit epilogues' activation error beyond the output's rounding, relative to
# max(|y|, 1): gelu_tanh takes the hardware tanh, whose absolute error the 1 + tanh
# cancellation keeps in the negative tail (5.5e-6 measured; kernels/matmul_device.cuh).
ACT_ERR_16BIT = 1e-4


@pytest.mark.cuda(1)
@_skip_no_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("m, n", [(8192, 256), (40, 4096), (3, 4096)])
def test_activation_16bit_elementwise(dtype, act, m, n):
    """Every output of the smooth activations of a 16-bit linear within the output's rounding
    plus ACT_ERR_16BIT of max(|y|, 1) of float64, element by element, on the epilogues these
    shapes take (full tiles; row blocks partly past M; few rows): the pre-activation is exact
    (one non-zero product per output, scaled by powers of two)."""
    k = 64
    lo, hi = (-8.0, 8.0) if m > 64 else (-6.0, -1.0)  # few rows: the tail, where errors peak
    rows = torch.linspace(lo, hi, m, dtype=torch.float64).to(dtype)
    x = torch.zeros(m, k, dtype=dtype)
    x[:, 0] = rows
    w = torch.zeros(n, k, dtype=dtype)
    w[:, 0] = 2.0 ** (torch.arange(n) % 4 - 2).to(dtype)  # x 1/4, 1/2, 1, 2
    y = ops.linear(x.cuda(), w.cuda(), None, act).double().cpu()
    v = rows.double()[:, None] * w[:, 0].double()[None, :]
    ref = _tail_accurate_ref(v, act)
    half_ulp = 2.0**-9 if dtype == torch.bfloat16 else 2.0**-12  # relative rounding of y
    err = (y - ref).abs() / ref.abs().clamp(min=1.0)
    bound = 2 * half_ulp + ACT_ERR_16BIT
    assert err.max().item() <= bound, (act, err.max().item(), v.flatten()[err.argmax()].item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_and_1d_inputs(device, dtype):
    a = _rand(2, 3, 9, 20, dtype=dtype, device=device)
    b = _rand(20, 11, dtype=dtype, device=device)
    out = ops.matmul(a, b)
    assert out.shape == (2, 3, 9, 11)
    assert _rel_err(out, a.double() @ b.double()) < RTOL[dtype]

    x = _rand(4, 5, 6, 24, dtype=dtype, device=device)
    w = _rand(10, 24, dtype=dtype, device=device)
    bias = _rand(10, dtype=dtype, device=device)
    y = ops.linear(x, w, bias, "silu")
    assert y.shape == (4, 5, 6, 10)
    assert _rel_err(y, F.silu(x.double() @ w.double().t() + bias.double())) < RTOL[dtype]

    x1 = _rand(24, dtype=dtype, device=device)  # 1-D input, as F.linear allows
    y1 = ops.linear(x1, w, bias)
    assert y1.shape == (10,)
    assert _rel_err(y1, x1.double() @ w.double().t() + bias.double()) < RTOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_noncontiguous_and_transposed_inputs(device, dtype):
    m, n, k = 37, 45, 52
    variants_a = {
        "contiguous": _rand(m, k, dtype=dtype, device=device),
        "transposed": _rand(k, m, dtype=dtype, device=device).t(),
        "sliced": _rand(m, 2 * k, dtype=dtype, device=device)[:, ::2],
        "row_slice": _rand(m, k + 8, dtype=dtype, device=device)[:, 3 : 3 + k],
        "expanded": _rand(1, k, dtype=dtype, device=device).expand(m, k),
        "misaligned": _rand(m * k + 1, dtype=dtype, device=device)[1:].view(m, k),
    }
    variants_b = {
        "contiguous": _rand(k, n, dtype=dtype, device=device),
        "transposed": _rand(n, k, dtype=dtype, device=device).t(),
        "sliced": _rand(2 * k, n, dtype=dtype, device=device)[::2],
        "expanded": _rand(k, 1, dtype=dtype, device=device).expand(k, n),
    }
    for na, a in variants_a.items():
        for nb, b in variants_b.items():
            out = ops.matmul(a, b)
            assert _rel_err(out, a.double() @ b.double()) < RTOL[dtype], (na, nb)
    # linear with a transposed weight view and a strided bias
    x = _rand(3, m, k, dtype=dtype, device=device).transpose(0, 1)  # [m, 3, k], not contiguous
    w = _rand(k, n, dtype=dtype, device=device).t()  # [n, k] with strides (1, n)
    bias = _rand(2 * n, dtype=dtype, device=device)[::2]
    y = ops.linear(x, w, bias, "gelu")
    assert y.shape == (m, 3, n)
    assert _rel_err(y, F.gelu(x.double() @ w.double().t() + bias.double())) < RTOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_empty_dimensions(device):
    dt = torch.float32
    assert ops.matmul(torch.empty(0, 5, device=device), torch.randn(5, 3, device=device)).shape == (
        0,
        3,
    )
    assert ops.matmul(torch.randn(4, 5, device=device), torch.empty(5, 0, device=device)).shape == (
        4,
        0,
    )
    out = ops.matmul(torch.randn(4, 0, device=device), torch.randn(0, 3, device=device))
    assert out.shape == (4, 3) and (out == 0).all()
    # K == 0: the epilogue still applies bias and activation
    bias = torch.tensor([-1.0, 0.5, 2.0], dtype=dt, device=device)
    y = ops.linear(torch.randn(4, 0, device=device), torch.randn(3, 0, device=device), bias, "relu")
    assert torch.equal(y, F.relu(bias).expand(4, 3))
    for half in (torch.float16, torch.bfloat16):
        y = ops.linear(
            torch.randn(2, 0, device=device, dtype=half),
            torch.randn(3, 0, device=device, dtype=half),
            bias.to(half),
            "none",
        )
        assert torch.equal(y, bias.to(half).expand(2, 3))


@pytest.mark.parametrize("device", DEVICES)
def test_errors(device):
    a = torch.randn(4, 5, device=device)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        ops.matmul(a, torch.randn(6, 3, device=device))
    with pytest.raises(RuntimeError, match="same dtype"):
        ops.matmul(a, torch.randn(5, 3, device=device, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="b must be 2-D"):
        ops.matmul(a, torch.randn(2, 5, 3, device=device))
    with pytest.raises(RuntimeError, match="at least 2 dimensions"):
        ops.matmul(torch.randn(5, device=device), torch.randn(5, 3, device=device))
    with pytest.raises(RuntimeError, match="supported dtypes"):
        ops.matmul(a.int(), torch.randn(5, 3, device=device).int())
    w = torch.randn(3, 5, device=device)
    with pytest.raises(RuntimeError, match="features"):
        ops.linear(torch.randn(4, 6, device=device), w)
    with pytest.raises(RuntimeError, match="bias must be 1-D"):
        ops.linear(a, w, torch.randn(4, device=device))
    with pytest.raises(ValueError, match="activation"):
        ops.linear(a, w, None, "tanh")
    with pytest.raises(RuntimeError, match="unknown activation"):
        torch.ops.fastcomm.linear(a, w, None, "tanh")
    if device == "cuda":
        with pytest.raises(RuntimeError, match="same device"):
            ops.matmul(a, torch.randn(5, 3))


# --------------------------------------------------------------- gradients


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_gradients_match_torch(device, act, with_bias):
    torch.manual_seed(0)
    x = torch.randn(2, 9, 23, device=device, requires_grad=True)
    w = torch.randn(17, 23, device=device, requires_grad=True)
    b = torch.randn(17, device=device, requires_grad=True) if with_bias else None
    gy = torch.randn(2, 9, 17, device=device)

    y = ops.linear(x, w, b, act)
    grads = torch.autograd.grad(y, [x, w] + ([b] if with_bias else []), gy)

    x2, w2 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b2 = b.detach().double().requires_grad_() if with_bias else None
    y2 = _ref_act(F.linear(x2, w2, b2), act)
    refs = torch.autograd.grad(y2, [x2, w2] + ([b2] if with_bias else []), gy.double())
    assert _rel_err(y, y2) < 1e-5
    for g, r in zip(grads, refs):
        assert g.dtype == torch.float32
        assert _rel_err(g, r) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_gradients_half(device, dtype):
    x = _rand(33, 40, dtype=dtype, device=device).requires_grad_()
    w = _rand(24, 40, dtype=dtype, device=device).requires_grad_()
    b = _rand(24, dtype=dtype, device=device).requires_grad_()
    gy = _rand(33, 24, dtype=dtype, device=device)
    grads = torch.autograd.grad(ops.linear(x, w, b, "gelu_tanh"), [x, w, b], gy)
    x2, w2, b2 = (t.detach().double().requires_grad_() for t in (x, w, b))
    refs = torch.autograd.grad(
        F.gelu(F.linear(x2, w2, b2), approximate="tanh"), [x2, w2, b2], gy.double()
    )
    for g, r in zip(grads, refs):
        assert g.dtype == dtype
        assert _rel_err(g, r) < 4 * RTOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_gradients_match_torch(device):
    a = torch.randn(3, 11, 19, device=device, requires_grad=True)
    b = torch.randn(19, 7, device=device, requires_grad=True)
    gy = torch.randn(3, 11, 7, device=device)
    ga, gb = torch.autograd.grad(ops.matmul(a, b), [a, b], gy)
    a2, b2 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ra, rb = torch.autograd.grad(torch.matmul(a2, b2), [a2, b2], gy.double())
    assert _rel_err(ga, ra) < 1e-5 and _rel_err(gb, rb) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_float64(device):
    kw = dict(dtype=torch.float64, device=device, requires_grad=True)
    a, b = torch.randn(2, 5, 4, **kw), torch.randn(4, 3, **kw)
    assert torch.autograd.gradcheck(ops.matmul, (a, b))
    x, w, bias = torch.randn(6, 4, **kw), torch.randn(5, 4, **kw), torch.randn(5, **kw)
    for act in ("none", "gelu", "gelu_tanh", "silu"):
        assert torch.autograd.gradcheck(
            lambda x, w, bias: ops.linear(x, w, bias, act), (x, w, bias)
        )
    # relu: keep pre-activations away from the kink
    x = (torch.rand(6, 4, dtype=torch.float64, device=device) + 0.5).requires_grad_()
    w = (
        torch.rand(5, 4, dtype=torch.float64, device=device)
        * torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0], dtype=torch.float64, device=device)[:, None]
    ).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: ops.linear(x, w, None, "relu"), (x, w))


def _fastcomm_calls(fn: Callable[[], object]) -> list[tuple[str, str]]:
    """The torch.ops.fastcomm calls fn makes, as (op, activation or "")."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "fastcomm":
                name = func.__name__.split(".")[0]
                # an argument left at its default is not passed on: linear's is "none"
                act = args[3] if len(args) > 3 else (kwargs or {}).get("activation", "none")
                calls.append((name, act if name == "linear" else ""))
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu"])
def test_linear_keeps_pre_activation_for_backward(device, act):
    """Under autograd, linear() runs the product with its bias and torch's activation, whose
    saved pre-activation leaves the backward two matmuls (dX, dW); the op called directly
    recomputes the pre-activation in its backward (a fused linear "none" more), and without
    grad the activation stays fused. The two backwards agree."""
    f32 = torch.float32
    x = _rand(6, 20, dtype=f32, device=device).requires_grad_()
    w = _rand(12, 20, dtype=f32, device=device).requires_grad_()
    b = _rand(12, dtype=f32, device=device).requires_grad_()
    gy = _rand(6, 12, dtype=f32, device=device)
    y = None

    def forward():
        nonlocal y
        y = ops.linear(x, w, b, act)

    assert _fastcomm_calls(forward) == [("linear", "none")]
    grads = []
    assert _fastcomm_calls(lambda: grads.extend(torch.autograd.grad(y, [x, w, b], gy))) == [
        ("matmul", ""),
        ("matmul", ""),
    ]
    y_op = torch.ops.fastcomm.linear(x, w, b, act)
    torch.testing.assert_close(y_op, y, rtol=1e-5, atol=1e-6)
    op_grads = []
    backward = _fastcomm_calls(lambda: op_grads.extend(torch.autograd.grad(y_op, [x, w, b], gy)))
    assert backward == [("linear", "none"), ("matmul", ""), ("matmul", "")]
    for g, r in zip(grads, op_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert _fastcomm_calls(lambda: ops.linear(x, w, b, act)) == [("linear", act)]
    assert _fastcomm_calls(lambda: ops.linear(x.detach(), w.detach(), b.detach(), act)) == [
        ("linear", act)
    ]


# ----------------------------------------------------------------- opcheck


def _opcheck_samples(device):
    def t(*s, rg=False, dtype=torch.float32):
        return torch.randn(*s, device=device, dtype=dtype, requires_grad=rg)

    mm = [
        (t(5, 7), t(7, 3)),
        (t(2, 5, 7, rg=True), t(7, 3, rg=True)),
        (t(7, 5).t(), t(3, 7, rg=True).t()),
        (t(6, 8, dtype=torch.bfloat16), t(8, 4, dtype=torch.bfloat16)),
    ]
    lin = [
        (t(5, 7), t(3, 7), None, "none"),
        (t(2, 5, 7, rg=True), t(3, 7, rg=True), t(3, rg=True), "gelu"),
        (t(4, 7, rg=True), t(3, 7, rg=True), t(3, rg=True), "relu"),
        (t(4, 7, rg=True), t(3, 7, rg=True), None, "silu"),
        (
            t(4, 8, dtype=torch.float16),
            t(3, 8, dtype=torch.float16),
            t(3, dtype=torch.float16),
            "gelu_tanh",
        ),
    ]
    return mm, lin


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    mm, lin = _opcheck_samples(device)
    for args in mm:
        torch.library.opcheck(torch.ops.fastcomm.matmul.default, args)
    for args in lin:
        torch.library.opcheck(torch.ops.fastcomm.linear.default, args)


# ---------------------------------------------------------- module, compile


def test_fused_linear_module_matches_nn_linear():
    torch.manual_seed(3)
    ref = torch.nn.Linear(12, 7)
    torch.manual_seed(3)
    mod = FusedLinear(12, 7, activation="gelu")
    assert torch.equal(ref.weight, mod.weight) and torch.equal(ref.bias, mod.bias)
    assert set(mod.state_dict()) == set(ref.state_dict())
    x = torch.randn(4, 12)
    torch.testing.assert_close(mod(x), F.gelu(ref(x)), rtol=1e-5, atol=1e-6)
    assert "activation='gelu'" in repr(mod) and "in_features=12" in repr(mod)
    nob = FusedLinear(12, 7, bias=False, dtype=torch.bfloat16)
    assert nob.bias is None and nob.weight.dtype == torch.bfloat16
    assert "bias=False" in repr(nob)
    shared = FusedLinear.from_linear(ref, activation="relu")
    torch.testing.assert_close(shared(x), F.relu(ref(x)), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        FusedLinear(3, 4, activation="tanh")


class _MLP(torch.nn.Module):
    def __init__(self, device, dtype=torch.float32):
        super().__init__()
        self.fc1 = FusedLinear(16, 32, activation="gelu", device=device, dtype=dtype)
        self.fc2 = FusedLinear(32, 32, activation="silu", device=device, dtype=dtype)
        self.fc3 = FusedLinear(32, 8, bias=False, device=device, dtype=dtype)

    def forward(self, x):
        return self.fc3(self.fc2(self.fc1(x)) + 1.0)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    model = _MLP(device)
    x = torch.randn(4, 5, 16, device=device)
    eager = model(x)
    eager.sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    for p, g in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------ CUDA kernel paths


def _cuda_cc():
    return torch.cuda.get_device_capability() if HAS_CUDA else (0, 0)


def _check_all_layouts(device, dtype, shapes, acts=("none", "gelu")):
    for m, n, k in shapes:
        a = _rand(m, k, dtype=dtype, device=device)
        at = _rand(k, m, dtype=dtype, device=device).t()
        b = _rand(k, n, dtype=dtype, device=device)
        bt = _rand(n, k, dtype=dtype, device=device).t()
        for name_a, aa in (("a", a), ("a^T", at)):
            for name_b, bb in (("b", b), ("b^T", bt)):
                _poison_cuda_cache(device)
                out = ops.matmul(aa, bb)
                err = _rel_err(out, aa.double() @ bb.double())
                assert err < RTOL[dtype], (m, n, k, name_a, name_b, err)
        w = bt.t()  # [n, k] contiguous
        bias = _rand(n, dtype=dtype, device=device)
        for act in acts:
            _poison_cuda_cache(device)
            y = ops.linear(a, w, bias, act)
            err = _rel_err(y, _ref_act(a.double() @ w.double().t() + bias.double(), act))
            assert err < RTOL[dtype], (m, n, k, act, err)


@pytest.fixture
def matmul_settings() -> Iterator[Callable[..., None]]:
    """torchext._testing.set_matmul_config, reset after the test."""
    from torchext import _testing

    yield _testing.set_matmul_config
    _testing.reset_matmul_config()


def test_matmul_settings_override(matmul_settings):
    """The override replaces every setting (unset ones are auto) until reset; a bad value
    is a ValueError naming its FASTCOMM_MATMUL_* variable."""
    from torchext import _testing

    matmul_settings(impl="simt", tile="small", group=512)
    got = _testing.matmul_config()
    assert got == {
        "impl": "simt", "tile": "small", "sched": "auto", "epi": "auto", "raster": "auto",
        "group": "512", "splits": "0",
    }, got  # fmt: skip
    matmul_settings(splits=3)
    assert _testing.matmul_config()["splits"] == "3"
    matmul_settings(splits="auto")
    assert _testing.matmul_config()["splits"] == "0"
    matmul_settings(epi="offload")
    assert _testing.matmul_config()["impl"] == "auto"
    for kw, var in (
        ({"sched": "zigzag"}, "FASTCOMM_MATMUL_SCHED"),
        ({"epi": "tma2"}, "FASTCOMM_MATMUL_EPI"),
        ({"group": 128}, "FASTCOMM_MATMUL_GROUP"),
        ({"group": 100000}, "FASTCOMM_MATMUL_GROUP"),
        ({"group": "big"}, "FASTCOMM_MATMUL_GROUP"),
        ({"splits": 17}, "FASTCOMM_MATMUL_SPLITS"),
        ({"splits": -1}, "FASTCOMM_MATMUL_SPLITS"),
        ({"splits": "two"}, "FASTCOMM_MATMUL_SPLITS"),
    ):
        with pytest.raises(ValueError, match=var):
            matmul_settings(**kw)
    with pytest.raises(ValueError, match="no matmul setting cluster"):
        matmul_settings(cluster=2)


@pytest.mark.cuda(1)
@_skip_no_cuda
@pytest.mark.parametrize("impl", ["auto", "mma", "simt"])
@pytest.mark.parametrize("tile", ["auto", "large", "medium", "small", "narrow"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_kernel_paths(matmul_settings, impl, tile, dtype):
    """Each CUDA path on all operand layouts, odd and multi-tile shapes."""
    if impl == "mma" and _cuda_cc()[0] < 8:
        pytest.skip("mma.sync kernel needs sm_80+")
    matmul_settings(impl=impl, tile=tile)
    shapes = SHAPES + CUDA_SHAPES
    _check_all_layouts("cuda", dtype, shapes)


# (M, N, K) for the skinny kernel: M from 1 to its limit (forced; the default dispatch takes
# it at M = 1 off sm_90), odd N, K from one 16-byte load per lane to several 256-element
# stretches with a remainder, and a K long enough to split.
SKINNY_SHAPES = [(1, 1, 8), (2, 7, 8), (3, 129, 264), (5, 1000, 1032), (8, 4099, 4096),
                 (1, 3, 8200), (4, 64, 11008), (1, 4099, 4096), (1, 1001, 1032)]  # fmt: skip


# Small M (batch x tokens) on odd N and K: the skinny kernel (off sm_90: M = 1, B K-major)
# and the tensor-core kernels with K split over CTAs / blocks.
SMALL_M = [1, 2, 3, 8, 16, 31, 64, 128, 255, 256]


@pytest.mark.cuda(1)
@_skip_no_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_small_m(matmul_settings, dtype):
    """The default dispatch for every small M on odd N and K, every operand layout, with and
    without activation, against float64; and the kernel it names: split K where the tiles
    leave most SMs idle, not where they already keep enough SMs streaming."""
    matmul_settings()
    shapes = [(m, n, k) for m in SMALL_M for n, k in ((1000, 1032), (257, 4104), (4099, 520))]
    _check_all_layouts("cuda", dtype, shapes, acts=("none", "gelu_tanh"))
    probe_a = torch.empty(16, 4096, device="cuda", dtype=dtype)
    probe_b = torch.empty(4096, 11008, device="cuda", dtype=dtype)
    name = torch.ops.fastcomm._kernel_name(probe_a, probe_b)
    if _cuda_cc() == (9, 0):
        # 86 tiles of 128 x 128 keep more SMs streaming than the memory needs: no split
        assert name.startswith("wgmma coop 128x128") and " splitk " not in name, name
        name = torch.ops.fastcomm._kernel_name(
            probe_a.new_empty(256, 11008), probe_b.new_empty(11008, 4096)
        )
        assert name.startswith("wgmma coop 128x128 splitk 2 "), name  # 64 tiles, K = 11008
        name = torch.ops.fastcomm._kernel_name(probe_a, probe_b[:, :4096])
        assert name.startswith("wgmma coop 128x64") and " splitk " not in name, name
    elif _cuda_cc()[0] >= 8:
        assert name.startswith("mma 64x64 splitk "), name


@pytest.mark.cuda(1)
@_skip_no_cuda
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_skinny_kernel(matmul_settings, dtype, act):
    """The skinny kernel (B K-major: linear's weight as it is), forced on every M up to 8
    and as the default choice at M = 1 off sm_90: with and without bias on odd shapes, an A
    that is not K-major (copied) and a strided weight view, against float64. The default
    takes it only at M = 1 with B K-major and only off sm_90 (there the Hopper kernel);
    forcing it where it cannot run (B N-major, M > 8, K not a multiple of 8) raises."""
    auto_skinny = not _is_sm90  # the default's choice at M = 1
    for impl in ("skinny", "auto"):
        matmul_settings(impl=impl)
        for m, n, k in SKINNY_SHAPES:
            x = _rand(m, k, dtype=dtype, device="cuda")
            w = _rand(n, k, dtype=dtype, device="cuda")
            b = _rand(n, dtype=dtype, device="cuda")
            name = torch.ops.fastcomm._kernel_name(x, w.t(), act)
            if impl == "skinny" or (m == 1 and auto_skinny):
                assert name.startswith("skinny k-major splits "), (impl, m, n, k, name)
            else:
                assert not name.startswith("skinny"), (impl, m, n, k, name)
            for bias in (None, b):
                _poison_cuda_cache("cuda")
                y = ops.linear(x, w, bias, act)
                pre = x.double() @ w.double().t()
                ref = _ref_act(pre + bias.double() if bias is not None else pre, act)
                assert _rel_err(y, ref) < RTOL[dtype], (impl, m, n, k, bias is None)
            y = ops.matmul(x, w.t())
            assert _rel_err(y, x.double() @ w.double().t()) < RTOL[dtype], "matmul"
        for m in (1, 5) if impl == "skinny" else (1,):
            x_m_major = _rand(520, m, dtype=dtype, device="cuda").t()
            w = _rand(333, 520, dtype=dtype, device="cuda")
            name = torch.ops.fastcomm._kernel_name(x_m_major, w.t(), act)
            assert name.startswith("skinny k-major ") == (impl == "skinny" or auto_skinny), name
            ref = _ref_act(x_m_major.double() @ w.double().t(), act)
            assert _rel_err(ops.linear(x_m_major, w, None, act), ref) < RTOL[dtype], "A M-major"
            wide = _rand(333, 1040, dtype=dtype, device="cuda")[:, :520]  # row stride 1040
            ref = _ref_act(x_m_major.double() @ wide.double().t(), act)
            assert _rel_err(ops.linear(x_m_major, wide, None, act), ref) < RTOL[dtype], "W view"
    matmul_settings(impl="skinny")
    x3 = _rand(2, 3, 520, dtype=dtype, device="cuda")  # M = 6 from batch dimensions
    w = _rand(333, 520, dtype=dtype, device="cuda")
    ref = _ref_act(x3.double() @ w.double().t(), act)
    assert _rel_err(ops.linear(x3, w, None, act), ref) < RTOL[dtype], "batch dims"
    for a, bb in (
        (_rand(9, 64, dtype=dtype, device="cuda"), _rand(32, 64, dtype=dtype, device="cuda").t()),
        (_rand(4, 60, dtype=dtype, device="cuda"), _rand(32, 60, dtype=dtype, device="cuda").t()),
        (_rand(1, 64, dtype=dtype, device="cuda"), _rand(64, 32, dtype=dtype, device="cuda")),
    ):
        with pytest.raises(RuntimeError, match="FASTCOMM_MATMUL_IMPL=skinny"):
            ops.matmul(a, bb)


# float32 problems for the skinny kernel: K a multiple of 4 (B K-major) or not (only B N-major
# takes those), a remainder of rows below one group of 4, N below and above one block of 128
# columns.
SKINNY_F32_SHAPES = [(1, 2, 4), (2, 7, 3), (3, 129, 264), (5, 33, 1), (8, 1000, 1030),
                     (1, 4099, 4096), (7, 65, 4101), (1, 3, 8200), (9, 130, 260)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_skinny_shapes(dtype):
    """The skinny kernel's problems (a few rows of A, odd N, K not a multiple of 4, a
    remainder below one group of rows) on the CPU kernel, every layout and activation."""
    _check_all_layouts("cpu", dtype, SKINNY_F32_SHAPES, acts=ACTS)


def _skinny_f32_expected(m: int, k: int, k_major: bool, tf32: bool) -> bool:
    """Whether the default dispatch gives float32 to the skinny kernel (kSkinnyRules)."""
    if k_major and k % 4 != 0:
        return False
    if tf32:
        return m <= 4 and not k_major
    return m <= 8


@pytest.mark.cuda(1)
@_skip_no_cuda
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("precision", ["highest", "high"])
def test_cuda_skinny_kernel_fp32(matmul_settings, fp32_precision, precision, act):
    """The skinny kernel on float32, forced and in the default dispatch (every M up to 8 under
    "highest", both layouts of B; up to 4 with b N-major under TF32): B K-major (linear's
    weight) and N-major (matmul's b, also with an odd row stride), A K-major, M-major or at a
    misaligned offset (copied), batch dimensions, with and without bias, against float64 at
    float32's tolerance (the kernel is exact float32 under TF32 too), bit for bit the same
    on repeated calls."""
    fp32_precision(precision)
    tf32 = precision != "highest"
    dt = torch.float32
    for impl in ("skinny", "auto"):
        matmul_settings(impl=impl)
        for m, n, k in SKINNY_F32_SHAPES:
            x = _rand(m, k, dtype=dt, device="cuda")
            w = _rand(n, k, dtype=dt, device="cuda")
            b_n = _rand(k, n, dtype=dt, device="cuda")
            b_wide = _rand(k, n + 3, dtype=dt, device="cuda")[:, :n]  # row stride n + 3
            bias = _rand(n, dtype=dt, device="cuda")
            x_m_major = _rand(k, m, dtype=dt, device="cuda").t()
            x_shifted = _rand(m, k + 1, dtype=dt, device="cuda")[:, 1:]  # base 4 bytes off
            k_major_ok = k % 4 == 0
            for bb, k_major in ((w.t(), True), (b_n, False), (b_wide, False)):
                if impl == "skinny" and (m > 8 or k_major and not k_major_ok):
                    with pytest.raises(RuntimeError, match="FASTCOMM_MATMUL_IMPL=skinny"):
                        torch.ops.fastcomm._kernel_name(x, bb, act)
                    continue
                name = torch.ops.fastcomm._kernel_name(x, bb, act)
                want = impl == "skinny" or _skinny_f32_expected(m, k, k_major, tf32)
                layout = "skinny k-major " if k_major else "skinny n-major "
                assert name.startswith(layout) == want, (impl, precision, m, n, k, name)
                if not want:
                    continue
                for aa in (x, x_m_major, x_shifted):
                    _poison_cuda_cache("cuda")
                    out = ops.matmul(aa, bb)
                    assert _rel_err(out, aa.double() @ bb.double()) < RTOL[dt], (m, n, k, name)
                    assert torch.equal(ops.matmul(aa, bb), out), ("not deterministic", m, n, k)
                if k_major:
                    for bias_ in (None, bias):
                        _poison_cuda_cache("cuda")
                        y = ops.linear(x, w, bias_, act)
                        pre = x.double() @ w.double().t()
                        ref = _ref_act(pre + bias_.double() if bias_ is not None else pre, act)
                        assert _rel_err(y, ref) < RTOL[dt], (m, n, k, bias_ is None, act)
    matmul_settings(impl="skinny")
    x3 = _rand(2, 3, 520, dtype=dt, device="cuda")  # M = 6 from batch dimensions
    b = _rand(520, 333, dtype=dt, device="cuda")
    assert torch.ops.fastcomm._kernel_name(x3[0], b).startswith("skinny n-major ")
    assert _rel_err(ops.matmul(x3, b), x3.double() @ b.double()) < RTOL[dt], "batch dims"
    with pytest.raises(RuntimeError, match="FASTCOMM_MATMUL_IMPL=skinny"):
        ops.matmul(_rand(9, 64, dtype=dt, device="cuda"), b[:64])  # 9 rows of A
    with pytest.raises(RuntimeError, match="FASTCOMM_MATMUL_IMPL=skinny"):
        ops.linear(_rand(2, 62, dtype=dt, device="cuda"), _rand(5, 62, dtype=dt, device="cuda"))


# K-major problems of the bulk form: N below the SMs and not a multiple of its 8 rows per
# stage, K whose rows end in a part piece (K * size not a multiple of 4096) or span one piece.
SKINNY_BULK_SHAPES = [(1, 5, 8), (2, 131, 1032), (3, 1000, 776), (4, 4099, 4104), (1, 300, 2048),
                      (4, 264, 11008), (5, 77, 1032), (8, 4099, 4104), (7, 1000, 776)]  # fmt: skip


@pytest.mark.cuda(1)
@_skip_no_cuda
@pytest.mark.parametrize("act", ACTS)
def test_cuda_skinny_bulk(matmul_settings, fp32_precision, act):
    """The bulk form of the K-major skinny kernel (float32 on sm_90, 1 to 8 rows of A: 5 to
    3 stages), forced: odd N below and above the SMs, rows of B ending in a part piece, a
    weight with a padded row stride, with and without bias, against float64; bit for bit the
    same on repeated calls. (Half types keep the warp form: test_cuda_skinny_kernel.)"""
    if not _is_sm90:
        pytest.skip("the bulk form needs sm_90")
    fp32_precision("highest")
    matmul_settings(impl="skinny")
    dtype = torch.float32
    for m, n, k in SKINNY_BULK_SHAPES:
        x = _rand(m, k, dtype=dtype, device="cuda")
        w = _rand(n, k, dtype=dtype, device="cuda")
        wide = _rand(n, k + 8, dtype=dtype, device="cuda")[:, :k]  # row stride k + 8
        bias = _rand(n, dtype=dtype, device="cuda")
        assert torch.ops.fastcomm._kernel_name(x, w.t(), act) == "skinny k-major bulk", (m, n, k)
        for ww in (w, wide):
            for bias_ in (None, bias):
                _poison_cuda_cache("cuda")
                y = ops.linear(x, ww, bias_, act)
                pre = x.double() @ ww.double().t()
                ref = _ref_act(pre + bias_.double() if bias_ is not None else pre, act)
                assert _rel_err(y, ref) < RTOL[dtype], (m, n, k, bias_ is None)
                assert torch.equal(ops.linear(x, ww, bias_, act), y), ("not deterministic", m, n)


@pytest.mark.cuda(1)
@_skip_no_cuda
@pytest.mark.parametrize("tile", ["auto", "large", "small"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_fp32_fp64_paths(matmul_settings, tile, dtype):
    """The CUDA-core kernel in both tilings (double always takes the 64x64 one)."""
    matmul_settings(tile=tile)
    probe = torch.empty(300, 520, device="cuda", dtype=dtype)
    name = torch.ops.fastcomm._kernel_name(probe, probe.t())
    wide = tile == "large" and dtype == torch.float32
    assert name.startswith("simt 128x128" if wide else "simt 64x64"), (tile, dtype, name)
    _check_all_layouts("cuda", dtype, SHAPES + CUDA_SHAPES[:2])


@pytest.mark.cuda(1)
@_skip_no_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_simt_split_k(matmul_settings, fp32_precision, dtype):
    """The CUDA-core kernel's wide tiles (32, 64 or 128 rows by the rows of A) and their K
    split (tiles too few for the SMs): the launcher's own count for tens of rows, forced
    counts on odd K (the last split shorter, more splits asked than K has slices), every
    layout, with bias and each activation, against float64; bit for bit the same on
    repeated calls and in a CUDA graph."""
    fp32_precision("highest")
    matmul_settings(impl="simt")
    a = torch.empty(64, 4096, device="cuda", dtype=dtype)
    name = torch.ops.fastcomm._kernel_name(a, torch.empty(4096, 4096, device="cuda", dtype=dtype))
    assert name.startswith("simt 64x128 splitk "), name
    big = torch.empty(4096, 4096, device="cuda", dtype=dtype)
    assert torch.ops.fastcomm._kernel_name(big, big) == "simt 128x128"
    for splits in (0, 1, 2, 3, 5, 16):
        matmul_settings(impl="simt", tile="large", splits=splits)
        for m, n, k in ((64, 300, 1001), (129, 130, 37), (40, 1000, 2056), (1, 5, 8), (31, 3, 70)):
            name = torch.ops.fastcomm._kernel_name(
                torch.empty(m, k, device="cuda", dtype=dtype),
                torch.empty(k, n, device="cuda", dtype=dtype),
            )
            rows = 32 if m <= 32 else 64 if m <= 64 else 128
            assert name.startswith(f"simt {rows}x128"), (splits, m, n, k, name)
            if splits > 1 and k >= 8 * splits:
                assert name.endswith(f" splitk {splits}"), (splits, m, n, k, name)
            x = _rand(m, k, dtype=dtype, device="cuda")
            w = _rand(n, k, dtype=dtype, device="cuda")
            bias = _rand(n, dtype=dtype, device="cuda")
            for xx, ww in ((x, w), (x.t().contiguous().t(), w.t().contiguous().t())):
                for act in ("none", "gelu_tanh", "relu"):
                    _poison_cuda_cache("cuda")
                    y = ops.linear(xx, ww, bias, act)
                    ref = _ref_act(xx.double() @ ww.double().t() + bias.double(), act)
                    assert _rel_err(y, ref) < RTOL[dtype], (splits, m, n, k, act)
                    assert torch.equal(ops.linear(xx, ww, bias, act), y), ("repeat", splits)
            out = ops.matmul(x, w.t())
            assert _rel_err(out, x.double() @ w.double().t()) < RTOL[dtype], (splits, m, n, k)
    matmul_settings(impl="simt")
    x = _rand(64, 2048, dtype=dtype, device="cuda")
    w = _rand(512, 2048, dtype=dtype, device="cuda")
    eager = ops.linear(x, w, None, "silu")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g):
        y = ops.linear(x, w, None, "silu")
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager), "graph replay"


@pytest.mark.cuda(1)
@_skip_no_cuda
def test_cuda_simt_vector_fetch(matmul_settings, fp32_precision):
    """Whole float32 tiles with aligned operands take the 16-byte fetch; a copy of the same
    operands one element off 16-byte alignment takes the checked fetch. Both sum in the same
    order, so they agree bit for bit, in every layout, with and without a K split, and match
    float64."""
    fp32_precision("highest")
    for splits in (0, 1, 3):
        matmul_settings(impl="simt", splits=splits)
        for m, n, k in ((64, 256, 64), (128, 384, 136), (256, 128, 1024), (192, 640, 48)):
            x = _rand(m, k, dtype=torch.float32, device="cuda")
            w = _rand(n, k, dtype=torch.float32, device="cuda")
            for a in (x, x.t().contiguous().t()):
                # The same values at storage offset 1: 4 bytes off 16-byte alignment.
                a_off = torch.empty(a.numel() + 1, device="cuda")[1:].as_strided(
                    a.shape, a.stride()
                )
                a_off.copy_(a)
                for b in (w.t(), w.t().contiguous()):
                    kernel = torch.ops.fastcomm._kernel_name(a, b)
                    assert torch.ops.fastcomm._kernel_name(a_off, b) == kernel
                    aligned = ops.matmul(a, b)
                    unaligned = ops.matmul(a_off, b)
                    where = (splits, m, n, k, a.stride(), b.stride(), kernel)
                    assert torch.equal(aligned, unaligned), where
                    ref = a.double() @ b.double()
                    assert _rel_err(aligned, ref) < RTOL[torch.float32], (splits, m, n, k)


@pytest.mark.cuda(1)
@_skip_no_cuda
def test_cuda_runs_on_current_stream():
    a = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 256, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000)  # keep the side stream busy
        y = ops.linear(a, w, None, "relu")
        y2 = y * 1  # same stream: must see the finished result
    torch.cuda.current_stream().wait_stream(s)
    assert _rel_err(y2, F.relu(a.double() @ w.double().t())) < RTOL[torch.bfloat16]


@pytest.mark.cuda(1)
@_skip_no_cuda
def test_cuda_graph_capture():
    a = torch.randn(256, 128, device="cuda", dtype=torch.float16)
    w = torch.randn(192, 128, device="cuda", dtype=torch.float16)
    b = torch.randn(192, device="cuda", dtype=torch.float16)
    ops.linear(a, w, b, "silu")  # warm-up outside capture
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            y = ops.linear(a, w, b, "silu")
    torch.cuda.current_stream().wait_stream(s)
    a.copy_(torch.randn_like(a))
    g.replay()
    torch.cuda.synchronize()
    assert _rel_err(y, F.silu(a.double() @ w.double().t() + b.double())) < RTOL[torch.float16]


_is_sm90 = HAS_CUDA and _cuda_cc() == (9, 0)

# Forced variants of the Hopper kernel (set_matmul_config): both schedules, the four
# cooperative tile widths, the three epilogues and both tile orders.
WGMMA_VARIANTS = {
    "coop256": {"sched": "coop", "tile": "large", "epi": "direct", "raster": "m"},
    "coop192": {"sched": "coop", "tile": "medium", "epi": "direct", "raster": "m"},
    "coop192_tma": {"sched": "coop", "tile": "medium", "epi": "tma", "raster": "m"},
    "coop192_tma_rn": {"sched": "coop", "tile": "medium", "epi": "tma", "raster": "n"},
    "coop256_tma": {"sched": "coop", "tile": "large", "epi": "tma", "raster": "m"},
    "coop256_tma_rn": {"sched": "coop", "tile": "large", "epi": "tma", "raster": "n"},
    "coop128_tma": {"sched": "coop", "tile": "small", "epi": "tma", "raster": "m"},
    "coop64": {"sched": "coop", "tile": "narrow", "epi": "direct", "raster": "m"},
    "coop64_rn": {"sched": "coop", "tile": "narrow", "epi": "direct", "raster": "n"},
    "coop64_tma": {"sched": "coop", "tile": "narrow", "epi": "tma", "raster": "m"},
    "coop64_tma_rn": {"sched": "coop", "tile": "narrow", "epi": "tma", "raster": "n"},
    "pingpong": {"sched": "pingpong", "raster": "m"},
    "pingpong_rn": {"sched": "pingpong", "raster": "n"},
    "coop256_offload": {"sched": "coop", "tile": "large", "epi": "offload", "raster": "m"},
    "coop256_offload_rn": {"sched": "coop", "tile": "large", "epi": "offload", "raster": "n"},
    "coop128_offload": {"sched": "coop", "tile": "small", "epi": "offload", "raster": "m"},
    "coop128_offload_rn": {"sched": "coop", "tile": "small", "epi": "offload", "raster": "n"},
}
# One tile; tiny; odd edges; K of one slice; TMA-store edges (N % 8 == 0, M
# and N not tile multiples, a warpgroup block wholly below M); many tiles per
# CTA (persistent loop, stage phases wrapping, ping-pong turns); long K.
WGMMA_SHAPES = [
    (128, 256, 64),
    (1, 1, 1),
    (7, 13, 5),
    (129, 257, 200),
    (300, 520, 1000),
    (1000, 1512, 700),
    (1000, 1500, 700),
    (4096, 4096, 512),
    (257, 1024, 4096),
]


@pytest.mark.cuda(1)
@pytest.mark.skipif(not _is_sm90, reason="wgmma/TMA kernel needs an sm_90 GPU")
@pytest.mark.parametrize("variant", sorted(WGMMA_VARIANTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_wgmma_kernel(matmul_settings, variant, dtype):
    """The Hopper kernel, forced (impl=wgmma raises if it cannot run), in each variant, on
    K- and M/N-major operands (loaded transposed)."""
    matmul_settings(impl="wgmma", **WGMMA_VARIANTS[variant])
    probe = torch.empty(4096, 4096, device="cuda", dtype=dtype)
    name = torch.ops.fastcomm._kernel_name(probe, probe)
    sched = WGMMA_VARIANTS[variant]["sched"]
    assert name.startswith(f"wgmma {sched}"), name
    if "epi" in WGMMA_VARIANTS[variant]:
        assert f"epi {WGMMA_VARIANTS[variant]['epi']} " in name, name
    _check_all_layouts("cuda", dtype, WGMMA_SHAPES, acts=ACTS)


@pytest.mark.cuda(1)
@pytest.mark.skipif(not _is_sm90, reason="wgmma/TMA kernel needs an sm_90 GPU")
def test_cuda_wgmma_offload_fallback(matmul_settings):
    """epi=offload exists for the cooperative 128x256 and 128x128 tiles: the 128x192 and
    128x64 tiles fall back to the TMA epilogue (and stay right), ping-pong keeps its direct
    stores."""
    probe = torch.empty(4096, 4096, device="cuda", dtype=torch.bfloat16)
    offload = {"impl": "wgmma", "epi": "offload", "raster": "m"}
    for tile, width in (("large", 256), ("small", 128)):
        matmul_settings(**offload, sched="coop", tile=tile)
        name = torch.ops.fastcomm._kernel_name(probe, probe)
        assert name.startswith(f"wgmma coop 128x{width} ") and " epi offload " in name, name
    for tile, width in (("medium", 192), ("narrow", 64)):
        matmul_settings(**offload, sched="coop", tile=tile)
        name = torch.ops.fastcomm._kernel_name(probe, probe)
        assert name.startswith(f"wgmma coop 128x{width} ") and " epi tma " in name, name
        _check_all_layouts("cuda", torch.bfloat16, [(300, 520, 1000)], acts=ACTS)
    matmul_settings(**offload, sched="pingpong")
    name = torch.ops.fastcomm._kernel_name(probe, probe)
    assert name.startswith("wgmma pingpong") and " epi " not in name, name


@pytest.mark.cuda(1)
@pytest.mark.skipif(not _is_sm90, reason="wgmma/TMA kernel needs an sm_90 GPU")
@pytest.mark.parametrize("raster", ["m", "n"])
@pytest.mark.parametrize("group", ["512", "768", "65536"])
def test_cuda_wgmma_tile_groups(matmul_settings, raster, group):
    """The tile-group size (group): groups of 2 or 3 tile columns / 4 or 6 tile rows, the
    last group partial on these shapes, and one group of everything; every tile is computed
    exactly once (the output is poisoned first)."""
    matmul_settings(impl="wgmma", sched="coop", tile="large", raster=raster, group=group)
    probe = torch.empty(4096, 4096, device="cuda", dtype=torch.bfloat16)
    name = torch.ops.fastcomm._kernel_name(probe, probe)
    assert f" raster {raster} group {group}" in name, name
    # 9 x 5 and 3 x 9 tiles of 128 x 256
    shapes = [(1100, 1200, 300), (300, 2200, 130)]
    _check_all_layouts("cuda", torch.bfloat16, shapes, acts=("none", "gelu"))


@pytest.mark.cuda(1)
@_skip_no_cuda
def test_cuda_default_dispatch(matmul_settings):
    """With every setting auto: half types take the Hopper kernel on sm_90 (small problems
    too) and the mma.sync kernel on other sm_80+ GPUs; float32 the CUDA-core kernel. The
    default path's results are right."""
    matmul_settings()
    bf = torch.bfloat16
    big = torch.empty(4096, 4096, device="cuda", dtype=bf)
    small = torch.empty(512, 512, device="cuda", dtype=bf)
    name_big = torch.ops.fastcomm._kernel_name(big, big)
    name_small = torch.ops.fastcomm._kernel_name(small, small)
    if _is_sm90:
        assert name_big.startswith("wgmma "), name_big
        assert name_small.startswith("wgmma coop 128x64"), name_small  # the 128 x 64 rule
        # the 128x256 tile: the offload epilogue where there is activation math to hide
        # under later tiles (512 tiles: ~4 per SM), the TMA epilogue at ~1 tile per SM
        assert name_big.startswith("wgmma coop 128x256") and " epi tma " in name_big, name_big
        for act, epi in (("relu", "tma"), ("gelu", "offload"), ("gelu_tanh", "offload"),
                         ("silu", "offload")):  # fmt: skip
            name = torch.ops.fastcomm._kernel_name(big, big, act)
            assert f" epi {epi} " in name, (act, name)
        name = torch.ops.fastcomm._kernel_name(big[:1024], big, "gelu_tanh")
        assert name.startswith("wgmma coop 128x256 epi tma "), name
        if torch.cuda.get_device_properties(0).multi_processor_count == 132:
            # 7 tiles of 128 x 128 per SM: the offload epilogue where there is activation math
            wide = torch.empty(14336, 4096, device="cuda", dtype=bf)
            name = torch.ops.fastcomm._kernel_name(big[:1024], wide.t(), "gelu")
            assert name.startswith("wgmma coop 128x128 epi offload "), name
            name = torch.ops.fastcomm._kernel_name(big[:1024], wide.t())
            assert name.startswith("wgmma coop 128x128 epi tma "), name
    elif _cuda_cc()[0] >= 8:
        assert name_big.startswith("mma ") and name_small.startswith("mma "), (name_big, name_small)
    f32 = torch.empty(64, 64, device="cuda")
    assert torch.ops.fastcomm._kernel_name(f32, f32) == "simt 64x64", "float32, small"
    f32 = torch.empty(4096, 4096, device="cuda")
    assert torch.ops.fastcomm._kernel_name(f32, f32) == "simt 128x128", "float32, fills the GPU"
    a = _rand(2048, 1024, dtype=bf, device="cuda")
    w = _rand(3072, 1024, dtype=bf, device="cuda")
    b = _rand(3072, dtype=bf, device="cuda")
    for act in ("none", "gelu_tanh"):
        _poison_cuda_cache("cuda")
        y = ops.linear(a, w, b, act)
        ref = _ref_act(a.double() @ w.double().t() + b.double(), act)
        assert _rel_err(y, ref) < RTOL[bf], act


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _wave_tile(m: int, n: int, sms: int, half: bool = True) -> int:
    """The cooperative tile width the default dispatch takes on sm_90 (the Hopper kernel's
    wave model): ceil(tiles / SMs) rounds, a round of 128 x 192 tiles (16-bit types only:
    `half`) taking 1.5 / 1.05 times one of 128 x 128 tiles, of 128 x 256 tiles 2 / 1.1 times;
    the narrower tile wins ties."""
    best, best_cost = 128, float(_cdiv(_cdiv(m, 128) * _cdiv(n, 128), sms))
    for bn, time in ((192, 1.5 / 1.05), (256, 2 / 1.1)):
        if bn == 192 and not half:
            continue
        cost = _cdiv(_cdiv(m, 128) * _cdiv(n, bn), sms) * time
        if cost < best_cost:
            best, best_cost = bn, cost
    return best


def _stream_k_tiles(
    m: int, n: int, k: int, bn: int, sms: int, half: bool = True, fast_memory: bool = True
) -> int:
    """The tiles of 128 x bn that the Hopper kernel shares out by K-slices (stream-K; 0:
    none): at least two rounds of tiles (three where the memory's peak bandwidth is below
    4 TB/s, not `fast_memory`), the last one part-full, and tiles / SMs rounds plus 4 K-slices
    of fix-up at most 0.95 of ceil(tiles / SMs) rounds; then one round plus the remainder."""
    tiles = _cdiv(m, 128) * _cdiv(n, bn)
    if tiles < (2 if fast_memory else 3) * sms or tiles % sms == 0:
        return 0
    kb = _cdiv(k, 64 if half else 32)
    if tiles / sms * kb + 4 > 0.95 * _cdiv(tiles, sms) * kb:
        return 0
    return sms + tiles % sms


# (M, N) of the decode / prefill grid and squares, with the tile width the wave model gives
# on 132 SMs (H100 SXM, H200).
WAVE_TILES_132 = {
    (2, 4096): 128, (8, 14336): 128, (16, 11008): 128, (128, 14336): 128, (256, 4096): 128,
    (256, 11008): 192, (256, 14336): 256, (512, 4096): 128, (512, 11008): 192,
    (512, 14336): 256, (1024, 1024): 128, (1024, 4096): 256, (1024, 11008): 256,
    (1024, 14336): 128, (2048, 2048): 256, (2048, 4096): 256, (4096, 4096): 256,
}  # fmt: skip
# (M, N) at K = 4096 -> stream-K tiles of the wave model's width on 132 SMs.
STREAM_K_TILES_132 = {
    (512, 11008): 0, (512, 14336): 0, (1024, 11008): 212, (1024, 14336): 0,
    (2048, 11008): 160, (2048, 14336): 0, (4096, 4096): 0, (8192, 8192): 0,
}  # fmt: skip


def _narrow_splits(
    m: int, n: int, k: int, sms: int, half: bool = True, k_major: bool = False,
    fast_memory: bool = True,
) -> int:  # fmt: skip
    """The K splits the 128 x 64 tile's rule gives on sm_90 (0: the rule does not take the
    problem): 128 x 128 tiles leave SMs idle and 128 x 64 ones fit in one wave; K split while a
    row of tiles has fewer than 64 CTAs or a CTA more than 8192 of K (each split keeping the
    wave and at least 2048 of K per CTA); not taken where a CTA's K stays above that. For
    16-bit types (`half`) a CTA may stream 11008 of K at M <= 64 on memory of at least 4 TB/s
    peak (`fast_memory`), and on slower memory at M <= 128 with B N-major (not `k_major`)."""
    tm, tn = _cdiv(m, 128), _cdiv(n, 64)
    if tm * _cdiv(n, 128) >= sms or tm * tn > sms:
        return 0
    small_a = m <= 64 if fast_memory else m <= 128 and not k_major
    max_k = 11008 if half and small_a else 8192
    s = 1
    while (s < 16 and tm * tn * (s + 1) <= sms and k // (s + 1) >= 2048
           and (tn * s < 64 or _cdiv(k, s) > max_k)):  # fmt: skip
        s += 1
    return 0 if _cdiv(k, s) > max_k else s


def _peak_memory_bandwidth() -> float:
    """Device 0's peak memory bandwidth in bytes/s (double data rate x bus width), from the
    CUDA runtime torch loaded."""
    import ctypes

    cudart = ctypes.CDLL(f"libcudart.so.{torch.version.cuda.split('.')[0]}")
    clock_khz, bus_bits = ctypes.c_int(0), ctypes.c_int(0)
    assert cudart.cudaDeviceGetAttribute(ctypes.byref(clock_khz), 36, 0) == 0  # MemoryClockRate
    assert cudart.cudaDeviceGetAttribute(ctypes.byref(bus_bits), 37, 0) == 0  # MemoryBusWidth
    assert clock_khz.value > 0 and bus_bits.value > 0
    return 2.0 * clock_khz.value * 1e3 * bus_bits.value / 8


@functools.lru_cache(maxsize=None)
def _fast_memory() -> bool:
    """Whether device 0's peak memory bandwidth is at least 4 TB/s (H200; not H100)."""
    return _peak_memory_bandwidth() >= 4e12


# (M, N, K) -> the 128 x 64 tile's split count on 132 SMs (0: the 128 x 128 tile with split K).
NARROW_SPLITS_132 = {
    (16, 4096, 4096): 1, (128, 4096, 4096): 1, (256, 4096, 4096): 1, (64, 4096, 8192): 1,
    (16, 4096, 11008): 1, (128, 4096, 11008): 2, (16, 2048, 4096): 2, (256, 2048, 8192): 2,
    (16, 8192, 4096): 1, (256, 4096, 11008): 0, (16, 11008, 4096): 0, (8, 14336, 4096): 0,
}  # fmt: skip


@pytest.mark.cuda(1)
@pytest.mark.skipif(not _is_sm90, reason="the Hopper rows of the dispatch need an sm_90 GPU")
def test_cuda_default_dispatch_rule(matmul_settings):
    """The default dispatch on sm_90, for matmul (b N-major) and linear (weight K-major):
    every problem the Hopper kernel's (the skinny kernel's M = 1 with B K-major too):
    cooperative 128 x 64 tile where its rule takes the problem, else its 128 x 128 tile (K
    split where its tiles leave SMs idle), 128 x 192 or 128 x 256 tile, by the wave model;
    never mma.sync."""
    matmul_settings()
    bf = torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if sms == 132:
        for (m, n), bn in WAVE_TILES_132.items():
            assert _wave_tile(m, n, sms) == bn, (m, n, bn)
        for (m, n), tiles in STREAM_K_TILES_132.items():
            assert _stream_k_tiles(m, n, 4096, _wave_tile(m, n, sms), sms) == tiles, (m, n)
        # on slower memory (H100) from three rounds of tiles: 2048 x 11008 (5.2 rounds), not 1024
        assert _stream_k_tiles(1024, 11008, 4096, 256, sms, fast_memory=False) == 0
        assert _stream_k_tiles(2048, 11008, 4096, 256, sms, fast_memory=False) == 160
    shapes = [(m, n, 4096) for m in (1, 2, 8, 16, 128, 256, 512, 1024, 2048)
              for n in (4096, 11008, 14336)] + [(1024, 1024, 1024), (2048, 2048, 2048)]  # fmt: skip
    for m, n, k in shapes:
        a = torch.empty(m, k, device="cuda", dtype=bf)
        b_n_major = torch.empty(k, n, device="cuda", dtype=bf)
        w = torch.empty(n, k, device="cuda", dtype=bf)
        for b, k_major in ((b_n_major, False), (w.t(), True)):
            name = torch.ops.fastcomm._kernel_name(a, b)
            splits = _narrow_splits(m, n, k, sms)
            if splits > 0:
                assert name.startswith("wgmma coop 128x64"), (m, n, k, k_major, name)
                assert (" splitk " in name) == (splits > 1), (m, n, k, k_major, name)
                continue
            bn = _wave_tile(m, n, sms)
            assert name.startswith(f"wgmma coop 128x{bn}"), (m, n, k, k_major, name)
            sk = _stream_k_tiles(m, n, k, bn, sms, fast_memory=_fast_memory())
            assert (f" streamk {sk} " in name) == (sk > 0), (m, n, k, k_major, name)
            if bn == 128 and k == 4096 and _cdiv(m, 128) * _cdiv(n, 128) * 2 <= sms:
                assert " splitk " in name, (m, n, k, name)  # at most half the SMs busy


@pytest.mark.cuda(1)
@_skip_no_cuda
def test_cuda_matmul_environment():
    """The FASTCOMM_MATMUL_* environment, read at the first matmul of a process: a good
    value forces its kernel, a bad one is an error naming the variable (at every call)."""
    import os
    import subprocess
    import sys

    code = """
import torch, torchext
a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
for _ in range(2):
    try:
        print(torch.ops.fastcomm._kernel_name(a, a))
    except RuntimeError as e:
        print("error:", str(e).splitlines()[0])
"""
    for setting, want in (
        ("FASTCOMM_MATMUL_IMPL=simt", "simt 64x64"),
        ("FASTCOMM_MATMUL_SCHED=zigzag", "error: fastcomm: FASTCOMM_MATMUL_SCHED=zigzag"),
        ("FASTCOMM_MATMUL_GROUP=128", "error: fastcomm: FASTCOMM_MATMUL_GROUP=128"),
    ):
        name, value = setting.split("=")
        env = {k: v for k, v in os.environ.items() if not k.startswith("FASTCOMM_MATMUL_")}
        env[name] = value
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        lines = out.stdout.splitlines()
        assert len(lines) == 2 and all(line.startswith(want) for line in lines), (setting, out)


@pytest.mark.cuda(1)
@_skip_no_cuda
def test_cuda_first_calls_on_fresh_threads():
    """A process whose first fused matmuls run on threads that never set a device (a user's
    thread; autograd's, for the backward GEMMs): each kernel's first launch happens there, and
    every result is right (a kernel set up on a thread without the device's context current
    failed with "invalid argument")."""
    import subprocess
    import sys

    code = """
import threading, torch, torchext
from torchext import ops
torch.manual_seed(0)
torch.set_float32_matmul_precision("high")
x = torch.randn(300, 520, device="cuda")
w = torch.randn(260, 520, device="cuda")
b = torch.randn(260, device="cuda")
def err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()
def first_calls(results):
    for dt in (torch.bfloat16, torch.float32):
        xd, wd, bd = x.to(dt), w.to(dt), b.to(dt)
        y = ops.linear(xd, wd, bd, "silu")
        ref = torch.nn.functional.silu(xd.double() @ wd.double().t() + bd.double())
        results.append((str(dt), "linear", err(y, ref)))
        z = ops.matmul(xd.t().contiguous().t(), wd.t())
        results.append((str(dt), "matmul", err(z, xd.double() @ wd.double().t())))
results = []
t = threading.Thread(target=first_calls, args=(results,))
t.start()
t.join()
xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
ops.linear(xr, wr, b, "gelu").sum().backward()
xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
torch.nn.functional.gelu(xd @ wd.t() + b.double()).sum().backward()
results.append(("float32", "backward dX", err(xr.grad, xd.grad)))
results.append(("float32", "backward dW", err(wr.grad, wd.grad)))
for r in results:
    print(*r)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.split() for line in out.stdout.splitlines()]
    assert len(lines) == 6, out.stdout
    for dt, *what, e in lines:
        assert float(e) < (2e-2 if "bfloat16" in dt else 3e-3), (dt, what, e)


def test_kernel_name_cpu():
    a = torch.randn(8, 4)
    assert torch.ops.fastcomm._kernel_name(a, torch.randn(4, 3)) == "cpu blocked"
    assert torch.ops.fastcomm._kernel_name(a, torch.randn(4, 3), "gelu") == "cpu blocked"
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        torch.ops.fastcomm._kernel_name(a, torch.randn(5, 3))
    with pytest.raises(RuntimeError, match="activation"):
        torch.ops.fastcomm._kernel_name(a, torch.randn(4, 3), "tanh")


# Split K in the Hopper kernel: forced split counts on every schedule and tile, and the
# default dispatch (the cooperative 128 x 128 tile where the tiles leave SMs idle).
WGMMA_SPLIT_VARIANTS = {
    "auto": {},
    "wgmma_auto": {"impl": "wgmma"},
    "coop128_s2": {"impl": "wgmma", "sched": "coop", "tile": "small", "splits": 2},
    "coop128_s5": {"impl": "wgmma", "sched": "coop", "tile": "small", "splits": 5},
    "coop256_s3": {"impl": "wgmma", "sched": "coop", "tile": "large", "splits": 3},
    "coop192_s3": {"impl": "wgmma", "sched": "coop", "tile": "medium", "splits": 3},
    "coop64_s3": {"impl": "wgmma", "sched": "coop", "tile": "narrow", "splits": 3},
    "pingpong_s3": {"impl": "wgmma", "sched": "pingpong", "splits": 3},
    "pingpong_s16": {"impl": "wgmma", "sched": "pingpong", "splits": 16},
}


def _assert_deterministic(a: torch.Tensor, b: torch.Tensor, repeats: int) -> None:
    """matmul(a, b) gives the same bits every time (split K sums its slices in a fixed
    order), with NaN-poisoned caches in between."""
    first = ops.matmul(a, b)
    for _ in range(repeats):
        _poison_cuda_cache("cuda")
        assert torch.equal(ops.matmul(a, b), first), "split K is not deterministic"


@pytest.mark.cuda(1)
@pytest.mark.skipif(not _is_sm90, reason="wgmma/TMA kernel needs an sm_90 GPU")
@pytest.mark.parametrize("variant", sorted(WGMMA_SPLIT_VARIANTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_wgmma_split_k(matmul_settings, variant, dtype):
    """The Hopper kernel with K split over CTAs (float32 sums, then the ordered second pass
    with bias and activation) for small M on odd N and K, every operand layout and
    activation, batch dimensions, against float64; the split shows in the kernel name, K
    shorter than the split count clamps it, and the result is bitwise reproducible."""
    settings = WGMMA_SPLIT_VARIANTS[variant]
    matmul_settings(**settings)
    # 64 tiles of 128 x 128 over a long K: the default splits it
    probe_a = torch.empty(256, 11008, device="cuda", dtype=dtype)
    probe_b = torch.empty(11008, 4096, device="cuda", dtype=dtype)
    name = torch.ops.fastcomm._kernel_name(probe_a, probe_b)
    if "splits" in settings:
        assert name.startswith(f"wgmma {settings['sched']}"), name
        assert f" splitk {settings['splits']} " in name, name
    else:
        assert name.startswith("wgmma coop 128x128 splitk "), name
    shapes = [(m, n, k) for m in SMALL_M for n, k in ((1000, 1032), (257, 4104))]
    shapes += [(64, 4096, 4096), (200, 3000, 64), (5, 33, 40)]
    _check_all_layouts("cuda", dtype, shapes, acts=ACTS)
    # batch dimensions: M = 2 x 3 x 11 rows
    x = _rand(2, 3, 11, 1032, dtype=dtype, device="cuda")
    w = _rand(1000, 1032, dtype=dtype, device="cuda")
    b = _rand(1000, dtype=dtype, device="cuda")
    y = ops.linear(x, w, b, "gelu")
    ref = _ref_act(x.double() @ w.double().t() + b.double(), "gelu")
    assert _rel_err(y, ref) < RTOL[dtype], "batch dims"
    # one K-slice: the split count is clamped to it
    if "splits" in settings:
        name = torch.ops.fastcomm._kernel_name(probe_a[:, :64], probe_b[:64])
        assert " splitk " not in name, name
    _assert_deterministic(_rand(64, 4104, dtype=dtype, device="cuda"),
                          _rand(4104, 1000, dtype=dtype, device="cuda"), 3)  # fmt: skip


# Shapes that stream-K takes (tiles of the forced width on 132 SMs): odd M, N (N % 8 != 0:
# the direct epilogue) and K.
STREAM_K_SHAPES = [(2100, 6004, 1000), (2100, 4100, 1000), (1100, 9000, 2000), (1000, 9100, 3000)]
STREAM_K_VARIANTS = [
    "coop256", "coop256_tma", "coop256_tma_rn", "coop256_offload", "coop192_tma",
    "coop128_tma", "coop128_offload_rn",
]  # fmt: skip


@pytest.mark.cuda(1)
@pytest.mark.skipif(not _is_sm90, reason="wgmma/TMA kernel needs an sm_90 GPU")
@pytest.mark.parametrize("variant", STREAM_K_VARIANTS)
def test_cuda_wgmma_stream_k(matmul_settings, variant):
    """Stream-K (the last round plus the remainder of the tiles shared out by K-slices, two
    CTAs per shared tile, the float32 fix-up): every layout and activation against float64
    in each epilogue, bitwise reproducible, and within float32 rounding of whole tiles per
    CTA (splits=1)."""
    settings = {"impl": "wgmma", **WGMMA_VARIANTS[variant]}
    matmul_settings(**settings)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bn = {"large": 256, "medium": 192, "small": 128}[settings["tile"]]
    fast = _fast_memory()
    shapes = [s for s in STREAM_K_SHAPES if _stream_k_tiles(*s, bn, sms, fast_memory=fast)]
    if not shapes:
        pytest.skip(f"no stream-K shape on {sms} SMs")
    bf = torch.bfloat16
    for m, n, k in shapes:
        a = torch.empty(m, k, device="cuda", dtype=bf)
        name = torch.ops.fastcomm._kernel_name(a, torch.empty(k, n, device="cuda", dtype=bf))
        sk = _stream_k_tiles(m, n, k, bn, sms, fast_memory=fast)
        assert f" streamk {sk} " in name, (m, n, k, name)
    _check_all_layouts("cuda", bf, shapes, acts=ACTS)
    m, n, k = shapes[0]
    a = _rand(m, k, dtype=bf, device="cuda")
    b = _rand(k, n, dtype=bf, device="cuda")
    _assert_deterministic(a, b, 2)
    shared = ops.matmul(a, b).float()
    matmul_settings(**settings, splits="1")
    assert " streamk " not in torch.ops.fastcomm._kernel_name(a, b)
    whole = ops.matmul(a, b).float()
    # the two sum the same products in another order: a few output ulps apart
    assert (shared - whole).abs().max() <= 4 * 2**-8 * whole.abs().max(), "stream-K vs whole tiles"


@pytest.mark.cuda(1)
@pytest.mark.skipif(not _is_sm90, reason="wgmma/TMA kernel needs an sm_90 GPU")
def test_cuda_tf32_stream_k(matmul_settings, fp32_precision):
    """Stream-K in the TF32 Hopper kernel (the direct epilogue after the fix-up): every layout
    and activation against float64 within TF32's bound."""
    fp32_precision("high")
    matmul_settings(impl="wgmma", sched="coop", tile="large")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    m, n, k = STREAM_K_SHAPES[0]
    tiles = _stream_k_tiles(m, n, k, 256, sms, half=False, fast_memory=_fast_memory())
    if not tiles:
        pytest.skip(f"no stream-K shape on {sms} SMs")
    a = torch.empty(m, k, device="cuda")
    name = torch.ops.fastcomm._kernel_name(a, torch.empty(n, k, device="cuda").t())
    assert " tf32" in name and f" streamk {tiles} " in name, name
    _check_tf32_layouts([(m, n, k)], acts=("none", "gelu"))


def _check_graph_replays(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, between: Callable[[int], object]
) -> torch.Tensor:
    """linear(x, w, b, "gelu") captured in a CUDA graph: each of 3 replays on fresh x equals
    the eager call bit for bit, with between(r) (eager products that reuse the allocator's
    blocks) and NaN-poisoned caches in between. Returns the graph's output."""
    ops.linear(x, w, b, "gelu")  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = ops.linear(x, w, b, "gelu")
    for r in range(3):
        x.copy_(_rand(*x.shape, dtype=x.dtype, device="cuda"))
        g.replay()
        expect = ops.linear(x, w, b, "gelu")
        between(r)
        _poison_cuda_cache("cuda")
        torch.cuda.synchronize()
        assert torch.equal(y, expect), f"replay {r}"
    return y


@pytest.mark.cuda(1)
@pytest.mark.skipif(not _is_sm90, reason="wgmma/TMA kernel needs an sm_90 GPU")
def test_cuda_wgmma_stream_k_graph_replays(matmul_settings):
    """Stream-K captured in a CUDA graph (the fix-up workspace and its zeroed flags from the
    graph's pool): every replay on fresh inputs equals the eager call bit for bit."""
    matmul_settings()
    bf = torch.bfloat16
    x = _rand(2048, 4096, dtype=bf, device="cuda")
    w = _rand(11008, 4096, dtype=bf, device="cuda")
    b = _rand(11008, dtype=bf, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if not _stream_k_tiles(
        2048, 11008, 4096, _wave_tile(2048, 11008, sms), sms, fast_memory=_fast_memory()
    ):
        pytest.skip(f"no stream-K on {sms} SMs")
    assert " streamk " in torch.ops.fastcomm._kernel_name(x, w.t(), "gelu"), "no stream-K"
    _check_graph_replays(x, w, b, lambda r: ops.matmul(x[: 300 + r], w[:520].t()))


@pytest.mark.cuda(1)
@pytest.mark.skipif(not _is_sm90, reason="wgmma/TMA kernel needs an sm_90 GPU")
@pytest.mark.parametrize("variant", ["auto", "coop128_s2", "coop64_s3", "pingpong_s3"])
def test_cuda_wgmma_split_k_graph_replays(matmul_settings, variant):
    """Split K captured in a CUDA graph (the workspace from the graph's pool, the second
    pass): every replay on fresh inputs equals the eager call bit for bit, with eager
    products of other shapes and split counts in between reusing the allocator's blocks."""
    matmul_settings(**WGMMA_SPLIT_VARIANTS[variant])
    bf = torch.bfloat16
    x = _rand(256, 11008, dtype=bf, device="cuda")
    w = _rand(4096, 11008, dtype=bf, device="cuda")
    b = _rand(4096, dtype=bf, device="cuda")
    assert " splitk " in torch.ops.fastcomm._kernel_name(x, w.t()), "no split to test"
    y = _check_graph_replays(
        x, w, b, lambda r: ops.matmul(_rand(40 + r, 1032, dtype=bf, device="cuda"), w[:1032, :1000])
    )
    ref = _ref_act(x.double() @ w.double().t() + b.double(), "gelu")
    assert _rel_err(y, ref) < RTOL[bf]


@pytest.mark.cuda(1)
@pytest.mark.skipif(not _is_sm90, reason="wgmma/TMA kernel needs an sm_90 GPU")
def test_cuda_wgmma_split_k_dispatch(matmul_settings):
    """The default dispatch's tile and split K on the decode / prefill grid (132 SMs: H100
    SXM, H200): the 128 x 64 tile where its rule takes the problem, with its own split count;
    elsewhere at small M the cooperative 128 x 128 kernel with split K; splits=1 turns a
    split off (the same tile, unsplit); M >= 1024 never splits."""
    bf = torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    matmul_settings()
    fast = _fast_memory()
    for (m, n, k), splits in NARROW_SPLITS_132.items():
        assert _narrow_splits(m, n, k, 132) == splits, (m, n, k)
        if sms != 132:
            continue
        splits = _narrow_splits(m, n, k, 132, fast_memory=fast)
        a = torch.empty(m, k, device="cuda", dtype=bf)
        name = torch.ops.fastcomm._kernel_name(a, torch.empty(k, n, device="cuda", dtype=bf))
        if splits == 0:
            assert name.startswith("wgmma coop 128x128"), (m, n, k, name)
        elif splits == 1:
            assert name.startswith("wgmma coop 128x64") and " splitk " not in name, (m, n, k, name)
        else:
            assert name.startswith("wgmma coop 128x64 splitk " + str(splits)), (m, n, k, name)
    for m, n, k in ((1024, 4096, 4096), (2048, 14336, 4096)):
        a = torch.empty(m, k, device="cuda", dtype=bf)
        b = torch.empty(k, n, device="cuda", dtype=bf)
        name = torch.ops.fastcomm._kernel_name(a, b)
        assert " splitk " not in name, (m, n, k, name)
    # K = 11008 unsplit at M <= 64 on memory of at least 4 TB/s peak; on slower memory with B
    # N-major only (matmul's b), to 128 rows, and never with B K-major (linear's weight).
    assert _narrow_splits(128, 4096, 11008, 132, fast_memory=False) == 1
    w = torch.empty(4096, 11008, device="cuda", dtype=bf)
    for m in (1, 16, 64, 128):
        splits = _narrow_splits(m, 4096, 11008, 132, k_major=True, fast_memory=fast)
        assert splits == (1 if fast and m <= 64 else 2), (m, fast, splits)
        a = torch.empty(m, 11008, device="cuda", dtype=bf)
        name = torch.ops.fastcomm._kernel_name(a, w.t())
        if sms == 132:
            assert name.startswith("wgmma coop 128x64"), (m, name)
            assert (" splitk 2 " in name) == (splits == 2), (m, fast, name)
    matmul_settings(splits=1)
    a = torch.empty(16, 4096, device="cuda", dtype=bf)
    name = torch.ops.fastcomm._kernel_name(a, torch.empty(4096, 11008, device="cuda", dtype=bf))
    assert name.startswith("wgmma coop 128x128") and " splitk " not in name, name
    name = torch.ops.fastcomm._kernel_name(a, torch.empty(4096, 2048, device="cuda", dtype=bf))
    assert name.startswith("wgmma coop 128x64") and " splitk " not in name, name


@pytest.mark.cuda(1)
@pytest.mark.skipif(not _is_sm90, reason="wgmma/TMA kernel needs an sm_90 GPU")
def test_cuda_wgmma_wave_tile_dispatch(matmul_settings, fp32_precision):
    """The default's cooperative tile by the wave model on 132 SMs: 128 x 192 where its
    tiles take fewer rounds (256 / 512 x 11008: 116 / 232 tiles against 86 / 172 of
    128 x 256), for 16-bit types only; 128 x 256 and 128 x 128 elsewhere."""
    if torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the expected tiles are those of 132 SMs")
    matmul_settings()
    expect = {(256, 11008): "128x192", (512, 11008): "128x192", (256, 14336): "128x256",
              (2048, 4096): "128x256", (1024, 14336): "128x128"}  # fmt: skip
    for dtype in (torch.bfloat16, torch.float16):
        for (m, n), tile in expect.items():
            a = torch.empty(m, 4096, device="cuda", dtype=dtype)
            w = torch.empty(n, 4096, device="cuda", dtype=dtype)
            name = torch.ops.fastcomm._kernel_name(a, w.t())
            assert name.startswith(f"wgmma coop {tile} "), (m, n, dtype, name)
    fp32_precision("high")
    a = torch.empty(256, 4096, device="cuda")
    name = torch.ops.fastcomm._kernel_name(a, torch.empty(11008, 4096, device="cuda").t())
    assert name.startswith("wgmma coop 128x256 tf32 "), name


# ------------------------------------------------ float32 and torch's matmul precision
#
# float32 products follow torch's matmul precision, read at every call as ATen's CUDA
# matmul reads it: "highest" (the default) is exact float32 on the CUDA-core kernel; with
# TF32 allowed ("high" / "medium", or torch.backends.cuda.matmul.allow_tf32 = True) the
# tensor-core kernels' TF32 forms run (float32 in memory, TF32 products, float32
# accumulation and output): on sm_90 the Hopper kernel, and the mma.sync kernel for small M
# where an operand is not K-major; on other sm_80+ GPUs the mma.sync kernel.

_tf32_tc = HAS_CUDA and _cuda_cc()[0] >= 8  # a tensor-core kernel takes TF32


@pytest.fixture
def fp32_precision() -> Iterator[Callable[[str], None]]:
    """Sets torch's float32 matmul precision ("highest", "high", "medium"); the precision
    and allow_tf32 in force before the test are restored after it."""
    old_precision = torch.get_float32_matmul_precision()
    old_allow = torch.backends.cuda.matmul.allow_tf32
    yield torch.set_float32_matmul_precision
    torch.backends.cuda.matmul.allow_tf32 = old_allow
    torch.set_float32_matmul_precision(old_precision)


def _tf32_scale(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """|A| @ |B| (+ |bias|) in float64: what bounds an output's rounding error elementwise."""
    scale = a.double().abs() @ b.double().abs()
    return scale + bias.double().abs() if bias is not None else scale


def _tf32_check(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor, k: int, what) -> None:
    """TF32 against a float64 reference. The tensor cores read float32 operands with 10
    mantissa bits (the low 13 bits dropped, a relative error below 2^-10 per operand, biased
    towards zero), multiply exactly and accumulate in float32, so an output is off by at most
    (2^-9 + K 2^-24) x (|A| @ |B|) elementwise, and an activation's slope (<= 1.2) scales that;
    the whole output is off by well under 2e-3 relative for random operands. A wrong or lost
    K-slice or tile is far outside both."""
    out = out.double()
    assert torch.isfinite(out).all(), ("non-finite values in the output", what)
    bound = 1.2 * (2.0**-9 + (k + 2) * 2.0**-24) * scale + 1e-6
    excess = ((out - ref).abs() - bound).max().item() if out.numel() else 0.0
    assert excess <= 0, (what, "elementwise error over the bound by", excess, k)
    assert _rel_err(out, ref) < 2e-3, (what, _rel_err(out, ref))


def test_fp32_precision_does_not_change_cpu_results(fp32_precision):
    """The CPU kernel is exact float32 under every precision setting."""
    a = _rand(33, 70, dtype=torch.float32, device="cpu")
    w = _rand(17, 70, dtype=torch.float32, device="cpu")
    b = _rand(17, dtype=torch.float32, device="cpu")
    fp32_precision("highest")
    exact = ops.linear(a, w, b, "gelu")
    assert torch.ops.fastcomm._kernel_name(a, w.t()) == "cpu blocked"
    for setting in ("high", "medium"):
        fp32_precision(setting)
        assert torch.equal(ops.linear(a, w, b, "gelu"), exact), setting
        assert torch.ops.fastcomm._kernel_name(a, w.t()) == "cpu blocked"


@pytest.mark.cuda(1)
@_skip_no_cuda
def test_cuda_fp32_precision_selects_kernel(fp32_precision):
    """The kernel follows the precision at each call: "highest" and allow_tf32 = False the
    CUDA-core kernel; "high", "medium" and allow_tf32 = True a TF32 kernel: on sm_90 the
    Hopper kernel (the transposed product where b is N-major); the mma.sync kernel on other
    sm_80+ GPUs; float64 and the half types are unaffected."""
    a = torch.empty(4096, 4096, device="cuda")
    small = torch.empty(64, 64, device="cuda")

    def name(x=a, y=None):
        return torch.ops.fastcomm._kernel_name(x, x if y is None else y)

    fp32_precision("highest")
    assert name() == "simt 128x128" and name(small) == "simt 64x64"
    for setting in ("high", "medium", "highest", "high"):
        fp32_precision(setting)
        tf32 = setting != "highest"
        if tf32 and _is_sm90:
            assert name().startswith("wgmma coop 128x256 tf32 transposed "), (setting, name())
            assert name(a, a.t()).startswith("wgmma coop 128x256 tf32 "), (setting, name(a, a.t()))
            assert name(small).startswith("wgmma coop 128x64 tf32 transposed "), name(small)
            assert name(small, small.t()).startswith("wgmma coop 128x64 tf32 "), setting
        elif tf32 and _tf32_tc:
            assert name().startswith("mma 128x128 tf32"), (setting, name())
            assert name(small).startswith("mma 64x128 tf32"), (setting, name(small))
        else:
            assert name().startswith("simt "), (setting, name())
    fp32_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = True
    assert (" tf32" in name()) == _tf32_tc, name()
    torch.backends.cuda.matmul.allow_tf32 = False
    assert name() == "simt 128x128", name()
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch's newer setter
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        assert (" tf32" in name()) == _tf32_tc, name()
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        assert name() == "simt 128x128", name()
    fp32_precision("high")
    d = torch.empty(512, 512, device="cuda", dtype=torch.float64)
    assert torch.ops.fastcomm._kernel_name(d, d) == "simt 64x64"
    h = torch.empty(4096, 4096, device="cuda", dtype=torch.bfloat16)
    assert " tf32" not in torch.ops.fastcomm._kernel_name(h, h)


@pytest.mark.cuda(1)
@_skip_no_cuda
def test_cuda_fp32_highest_is_the_exact_kernel(matmul_settings, fp32_precision):
    """Under "highest" float32 is exactly the CUDA-core kernel, bit for bit, on every layout;
    with TF32 allowed the same problem gives a different (TF32) result on sm_90."""
    fp32_precision("highest")
    for m, n, k in ((300, 520, 1000), (129, 257, 200), (1024, 768, 512)):
        a = _rand(m, k, dtype=torch.float32, device="cuda")
        b = _rand(k, n, dtype=torch.float32, device="cuda")
        w = _rand(n, k, dtype=torch.float32, device="cuda")
        bias = _rand(n, dtype=torch.float32, device="cuda")

        def calls(a=a, b=b, w=w, bias=bias):
            return [ops.matmul(a, b), ops.matmul(a, w.t()), ops.linear(a, w, bias, "silu")]

        matmul_settings()
        auto = calls()
        matmul_settings(impl="simt")
        simt = calls()
        for i, (x, y) in enumerate(zip(auto, simt)):
            assert torch.equal(x, y), (m, n, k, i)
        assert _rel_err(auto[0], a.double() @ b.double()) < RTOL[torch.float32]
        assert _rel_err(auto[1], a.double() @ w.double().t()) < RTOL[torch.float32]
        if _is_sm90:
            matmul_settings()
            fp32_precision("high")
            tf32 = ops.matmul(a, b)
            fp32_precision("highest")
            ref = a.double() @ b.double()
            assert _rel_err(tf32, ref) > 1e-5, "TF32 allowed but the result is exact float32"
            _tf32_check(tf32, ref, _tf32_scale(a, b), k, (m, n, k))


# (M, N, K) for the TF32 kernel: one tile; tiny; odd N and K (rows of float32 need 16-byte
# aligned strides: operands whose rows are not get copied into K-major buffers, C takes
# unpaired stores); K of one 32-wide slice; many tiles per CTA; long K; small M (split K).
TF32_SHAPES = [
    (128, 256, 32),
    (1, 1, 1),
    (7, 13, 5),
    (33, 65, 17),
    (129, 257, 200),
    (300, 520, 1001),
    (1000, 1500, 700),
    (2048, 2048, 512),
    (257, 1024, 4096),
    (16, 1000, 4100),
]


def _check_tf32_layouts(shapes, acts=ACTS) -> None:
    """matmul on A and B K-major or transposed, linear with each activation, against
    float64, under TF32."""
    dt = torch.float32
    for m, n, k in shapes:
        a = _rand(m, k, dtype=dt, device="cuda")
        at = _rand(k, m, dtype=dt, device="cuda").t()
        b = _rand(k, n, dtype=dt, device="cuda")
        bt = _rand(n, k, dtype=dt, device="cuda").t()
        for name_a, aa in (("a", a), ("a^T", at)):
            for name_b, bb in (("b", b), ("b^T", bt)):
                _poison_cuda_cache("cuda")
                out = ops.matmul(aa, bb)
                _tf32_check(
                    out,
                    aa.double() @ bb.double(),
                    _tf32_scale(aa, bb),
                    k,
                    (m, n, k, name_a, name_b),
                )
        w = bt.t()  # [n, k] contiguous: K-major as it is
        bias = _rand(n, dtype=dt, device="cuda")
        for act in acts:
            _poison_cuda_cache("cuda")
            y = ops.linear(a, w, bias, act)
            ref = _ref_act(a.double() @ w.double().t() + bias.double(), act)
            _tf32_check(y, ref, _tf32_scale(a, w.t(), bias), k, (m, n, k, act))


@pytest.mark.cuda(1)
@_skip_no_cuda
def test_cuda_tf32_matches_float64(matmul_settings, fp32_precision):
    """TF32 allowed, default dispatch: every layout and activation, odd sizes, against
    float64 within TF32's bound (the CUDA-core kernel before sm_80 passes it too)."""
    matmul_settings()
    fp32_precision("high")
    probe = torch.empty(2048, 2048, device="cuda")
    assert (" tf32" in torch.ops.fastcomm._kernel_name(probe, probe)) == _tf32_tc
    _check_tf32_layouts(TF32_SHAPES)


@pytest.mark.cuda(1)
@_skip_no_cuda
def test_cuda_tf32_small_m(matmul_settings, fp32_precision):
    """TF32 allowed, default dispatch, every small M on odd N and K, every layout, against
    float64; the kernel it names: on sm_90 the Hopper kernel's 128 x 64 tile, as the
    transposed product where b is N-major; the mma.sync kernel's TF32 form (split K) on other
    sm_80+ GPUs."""
    matmul_settings()
    fp32_precision("high")
    shapes = [(m, n, k) for m in SMALL_M for n, k in ((1000, 1032), (257, 4104), (4099, 520))]
    _check_tf32_layouts(shapes, acts=("none", "gelu_tanh"))
    a = torch.empty(16, 4096, device="cuda")
    b = torch.empty(4096, 4096, device="cuda")
    name = torch.ops.fastcomm._kernel_name(a, b)
    if _is_sm90:
        assert name.startswith("wgmma coop 128x64 tf32 transposed "), name
        name = torch.ops.fastcomm._kernel_name(a, b.t())
        assert name.startswith("wgmma coop 128x64 tf32 "), name
    elif _tf32_tc:
        assert name.startswith("mma 16x128 tf32 splitk "), name


@pytest.mark.cuda(1)
@pytest.mark.skipif(not _tf32_tc, reason="the mma.sync kernel needs sm_80+")
@pytest.mark.parametrize("tile", ["auto", "large", "small", "narrow"])
def test_cuda_tf32_mma(matmul_settings, fp32_precision, tile):
    """The mma.sync kernel's TF32 form, forced, in each tile (auto: row tiles of 16, 32 and
    64 up to 64 rows; narrow: row tiles at every M): every layout and activation against
    float64 (rows past M skipped, K split for small M), split K deterministic."""
    fp32_precision("high")
    matmul_settings(impl="mma", tile=tile)
    probe = torch.empty(16, 4096, device="cuda")
    name = torch.ops.fastcomm._kernel_name(probe, probe.t().contiguous())
    assert name.startswith("mma ") and " tf32" in name, name
    shapes = TF32_SHAPES + [(m, 1000, 1032) for m in (2, 17, 31, 33, 64, 255)]
    _check_tf32_layouts(shapes, acts=("none", "relu", "gelu_tanh"))
    _assert_deterministic(_rand(31, 4100, dtype=torch.float32, device="cuda"),
                          _rand(4100, 1000, dtype=torch.float32, device="cuda"), 2)  # fmt: skip


# Forced settings for the transposed TF32 product (b N-major: C^T = B^T A^T, b through
# registers) and the kernel-name part each must give: its default tile, the 128 x 64 tile
# (64 rows of A per stage where N <= 64), split K, and whole tiles (no stream-K).
TF32_TRANSPOSED_SETTINGS = [
    ({}, ""),
    ({"tile": "narrow"}, "128x64"),
    ({"tile": "small", "splits": 3}, "splitk 3"),
    ({"tile": "large", "splits": 1}, "128x256"),
]


@pytest.mark.cuda(1)
@pytest.mark.skipif(not _is_sm90, reason="wgmma/TMA kernel needs an sm_90 GPU")
@pytest.mark.parametrize("forced", range(len(TF32_TRANSPOSED_SETTINGS)))
def test_cuda_tf32_transposed(matmul_settings, fp32_precision, forced):
    """TF32 with b N-major on the Hopper kernel, run as C^T = B^T A^T with b read into
    registers: every small M, odd N and K, each layout of a, linear with an N-major weight
    and every activation, against float64; split K deterministic."""
    fp32_precision("high")
    settings, part = TF32_TRANSPOSED_SETTINGS[forced]
    matmul_settings(impl="wgmma", **settings)
    probe = torch.empty(64, 4096, device="cuda")
    name = torch.ops.fastcomm._kernel_name(probe, torch.empty(4096, 4096, device="cuda"))
    assert " tf32 transposed" in name and part in name, name
    shapes = [(m, 1000, 1032) for m in SMALL_M] + [(300, 520, 1001), (1000, 1500, 700), (7, 40, 5)]
    dt = torch.float32
    for m, n, k in shapes:
        b = _rand(k, n, dtype=dt, device="cuda")
        for a in (_rand(m, k, dtype=dt, device="cuda"), _rand(k, m, dtype=dt, device="cuda").t()):
            _poison_cuda_cache("cuda")
            out = ops.matmul(a, b)
            _tf32_check(out, a.double() @ b.double(), _tf32_scale(a, b), k, (m, n, k, settings))
        x = _rand(m, k, dtype=dt, device="cuda")
        w = b.t()  # [n, k] with k-stride n: linear multiplies by w.t() = b, N-major
        bias = _rand(n, dtype=dt, device="cuda")
        for act in ACTS:
            _poison_cuda_cache("cuda")
            y = ops.linear(x, w, bias, act)
            ref = _ref_act(x.double() @ b.double() + bias.double(), act)
            _tf32_check(y, ref, _tf32_scale(x, b, bias), k, (m, n, k, act, settings))
    _assert_deterministic(_rand(31, 4100, dtype=dt, device="cuda"),
                          _rand(4100, 1000, dtype=dt, device="cuda"), 2)  # fmt: skip


@pytest.mark.cuda(1)
@_skip_no_cuda
def test_cuda_tf32_batch_dims_and_strides(matmul_settings, fp32_precision):
    """TF32: batch dimensions, a misaligned base pointer and row strides that are not a
    multiple of 16 bytes (copied into aligned K-major buffers), broadcast (stride-0) bias."""
    matmul_settings()
    fp32_precision("high")
    dt = torch.float32
    x = _rand(2, 3, 11, 1030, dtype=dt, device="cuda")
    w = _rand(1001, 1030, dtype=dt, device="cuda")
    b = _rand(1001, dtype=dt, device="cuda")
    for act in ("none", "gelu"):
        y = ops.linear(x, w, b, act)
        assert y.shape == (2, 3, 11, 1001)
        ref = _ref_act(x.double() @ w.double().t() + b.double(), act)
        _tf32_check(y, ref, _tf32_scale(x, w.t(), b), 1030, act)
    a = _rand(4, 70, 300, dtype=dt, device="cuda")
    bb = _rand(300, 90, dtype=dt, device="cuda")
    _tf32_check(ops.matmul(a, bb), a.double() @ bb.double(), _tf32_scale(a, bb), 300, "batched")
    # misaligned base (offset by one element) and odd row strides
    base = _rand(257, 515, dtype=dt, device="cuda")
    a_odd = base[:, 1:514]  # [257, 513], base + 4 bytes, row stride 515
    wb = _rand(130, 515, dtype=dt, device="cuda")
    w_odd = wb[:, 2:]  # [130, 513]
    ref = a_odd.double() @ w_odd.double().t()
    _tf32_check(ops.linear(a_odd, w_odd), ref, _tf32_scale(a_odd, w_odd.t()), 513, "odd")
    b_exp = _rand(1, 130, dtype=dt, device="cuda").expand(513, 130)  # stride 0 along K
    ref = a_odd.double() @ b_exp.double()
    _tf32_check(ops.matmul(a_odd, b_exp), ref, _tf32_scale(a_odd, b_exp), 513, "stride 0")


# Forced variants of the TF32 Hopper kernel: both schedules, both cooperative tiles, split K.
TF32_VARIANTS = {
    "coop256": {"sched": "coop", "tile": "large"},
    # the 128 x 192 tile is for 16-bit types: float32 takes 128 x 256
    "coop192_as_256": {"sched": "coop", "tile": "medium"},
    "coop128": {"sched": "coop", "tile": "small", "raster": "n"},
    "pingpong": {"sched": "pingpong"},
    "coop128_s3": {"sched": "coop", "tile": "small", "splits": 3},
    "coop256_s2": {"sched": "coop", "tile": "large", "splits": 2},
    "coop64": {"sched": "coop", "tile": "narrow"},
    "coop64_s4": {"sched": "coop", "tile": "narrow", "splits": 4},
    "pingpong_s5": {"sched": "pingpong", "splits": 5},
}


@pytest.mark.cuda(1)
@pytest.mark.skipif(not _is_sm90, reason="the TF32 Hopper kernel needs an sm_90 GPU")
@pytest.mark.parametrize("variant", sorted(TF32_VARIANTS))
def test_cuda_tf32_wgmma_variants(matmul_settings, fp32_precision, variant):
    """The TF32 Hopper kernel forced in each schedule / tile / split: its name, every layout
    and activation against float64; the epilogue stores from registers (no TMA or offload
    epilogue for float32 outputs), split K is deterministic."""
    fp32_precision("high")
    settings = TF32_VARIANTS[variant]
    matmul_settings(impl="wgmma", epi="tma", **settings)
    probe = torch.empty(4096, 4096, device="cuda")
    name = torch.ops.fastcomm._kernel_name(probe, probe.t())  # b K-major
    assert name.startswith(f"wgmma {settings['sched']}") and " tf32" in name, name
    if settings.get("tile") == "medium":
        assert name.startswith("wgmma coop 128x256 "), name
    if "splits" in settings:
        assert f" splitk {settings['splits']} " in name, name
    elif settings["sched"] == "coop":
        assert " epi direct " in name, name  # epi=tma falls back for float32 outputs
    _check_tf32_layouts(TF32_SHAPES[:8], acts=("none", "relu", "gelu_tanh"))
    _assert_deterministic(_rand(64, 4100, dtype=torch.float32, device="cuda"),
                          _rand(4100, 1000, dtype=torch.float32, device="cuda"), 2)  # fmt: skip


@pytest.mark.cuda(1)
@pytest.mark.skipif(not _is_sm90, reason="the TF32 packing kernel runs for the sm_90 kernel")
def test_cuda_tf32_packed_operand_longer_than_a_grid_column(matmul_settings, fp32_precision):
    """matmul's M-major a is packed K-major in 32-wide K tiles; more K tiles than a grid's
    y dimension holds (65535) are walked by the same blocks, none left out."""
    fp32_precision("high")
    matmul_settings()
    m, n, k = 8, 24, 65535 * 32 + 1000
    a = _rand(k, m, dtype=torch.float32, device="cuda").t()
    b = _rand(n, k, dtype=torch.float32, device="cuda").t()
    assert torch.ops.fastcomm._kernel_name(a, b).startswith("wgmma ")
    _tf32_check(ops.matmul(a, b), a.double() @ b.double(), _tf32_scale(a, b), k, (m, n, k))


@pytest.mark.cuda(1)
@pytest.mark.skipif(not _is_sm90, reason="the Hopper rows of the dispatch need an sm_90 GPU")
def test_cuda_tf32_default_dispatch_rule(matmul_settings, fp32_precision):
    """TF32 allowed: float32 on K-major operands takes the half types' Hopper rows (the
    128 x 64 tile where its rule takes the problem, else the wave model's cooperative tile,
    K split where its tiles leave SMs idle), never the skinny kernel; with b N-major the
    skinny kernel up to 4 rows of a, the same rows on the transposed problem (M and N swapped)
    up to 128 rows, the 128 x 256 tile above unless K is at most 1024 and the 128 x 64 tiles
    fit in one wave; "highest" keeps the CUDA-core kernel."""
    matmul_settings()
    fp32_precision("high")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(m, n, 4096) for m in (1, 4, 5, 16, 256, 1024, 8192) for n in (4096, 11008)]
    shapes += [(1024, 1024, 1024), (512, 2048, 1024), (512, 2048, 2048), (2048, 2048, 1024)]
    for m, n, k in shapes:
        a = torch.empty(m, k, device="cuda")
        for b in (torch.empty(k, n, device="cuda"), torch.empty(n, k, device="cuda").t()):
            name = torch.ops.fastcomm._kernel_name(a, b)
            transposed = b.stride(1) == 1
            km, kn = (n, m) if transposed else (m, n)  # the kernel's problem
            tf32 = " tf32 transposed " if transposed else " tf32 "
            if transposed and m <= 4:
                assert name.startswith("skinny n-major "), (m, n, k, name)
                continue
            short_k_wave = k <= 1024 and _cdiv(km, 128) * _cdiv(kn, 64) <= sms
            if transposed and kn > 128 and not short_k_wave:
                # the 128 x 256 tile, split where it leaves SMs idle
                assert name.startswith("wgmma coop 128x256" + tf32), (m, n, k, name)
                continue
            splits = _narrow_splits(km, kn, k, sms, half=False)
            if splits > 0:
                assert name.startswith("wgmma coop 128x64" + tf32), (m, n, k, name)
                assert (" splitk " in name) == (splits > 1), (m, n, k, name)
                continue
            bn = _wave_tile(km, kn, sms, half=False)
            assert name.startswith(f"wgmma coop 128x{bn}" + tf32), (m, n, k, name)
            if bn == 128 and _cdiv(km, 128) * _cdiv(kn, 128) * 2 <= sms:
                assert " splitk " in name, (m, n, k, name)
    fp32_precision("highest")
    a = torch.empty(8192, 4096, device="cuda")
    assert torch.ops.fastcomm._kernel_name(a, a.t()) == "simt 128x128"


@pytest.mark.cuda(1)
@_skip_no_cuda
def test_cuda_tf32_graph_capture_and_gradients(matmul_settings, fp32_precision):
    """TF32 under CUDA-graph capture (the precision is read at capture), and autograd's
    backward GEMMs (transposed operands) under TF32."""
    matmul_settings()
    fp32_precision("high")
    x = _rand(300, 520, dtype=torch.float32, device="cuda")
    w = _rand(260, 520, dtype=torch.float32, device="cuda")
    b = _rand(260, dtype=torch.float32, device="cuda")
    ops.linear(x, w, b, "gelu")  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = ops.linear(x, w, b, "gelu")
    g.replay()
    torch.cuda.synchronize()
    ref = _ref_act(x.double() @ w.double().t() + b.double(), "gelu")
    _tf32_check(y, ref, _tf32_scale(x, w.t(), b), 520, "graph")
    xr = x.clone().requires_grad_()
    wr = w.clone().requires_grad_()
    ops.linear(xr, wr, b, "silu").sum().backward()
    xd = x.double().requires_grad_()
    wd = w.double().requires_grad_()
    F.silu(xd @ wd.t() + b.double()).sum().backward()
    assert _rel_err(xr.grad, xd.grad) < 2e-3 and _rel_err(wr.grad, wd.grad) < 2e-3
