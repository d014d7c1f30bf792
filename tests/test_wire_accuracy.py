"""The lossy wire dtypes on real gradients: benchmarks/wire_accuracy.py trains a small
character-level transformer with DDP over fastcomm, 2 simulated nodes x 2 CPU ranks, once per
FASTCOMM_WIRE_DTYPE, and measures every gradient all-reduce against the float64 sum of its
float32 inputs. One launch runs every wire dtype (a few steps of a tiny model); each wire dtype
is then checked on its own:

- the losses are finite, and within 2% of float32's at every step (the wire does not derail
  training over a few steps);
- every rank holds bit-identical all-reduce results and parameters;
- the relative L2 error of each all-reduce, ||wire - exact|| / ||exact||, is within the bound of
  ``error_bound`` in the script, and above zero for a lossy wire. That bound, per all-reduce of
  2 nodes with node partials p_1, p_2 and sum s: each of p_1, p_2 and s is rounded to the wire at
  most once (the float32 additions add 2^-24 of each), and one rounding moves element i by at most
  u |x_i| + h m_i + a, m_i the largest |x| of the scale block holding x_i, so

      rel. L2 error <= 1.25 * sum over x in {p_1, p_2, s} of
                       ((u + 2^-24) ||x|| + h ||m(x)|| + a sqrt(N)) / ||s||

  - none: u = h = a = 0: float32 reassociation only, 1.25 * 2^-24 (kappa + 1), where
    kappa = (||p_1|| + ||p_2||) / ||s|| (1 without cancellation between the nodes);
  - bf16: u = 2^-8 (8 significant bits): about 2^-8 * 1.25 (kappa + 1) = 2^-6.7 for kappa = 1;
  - fp16 (block-scaled like int8): u = 2^-11, h = 2^-24 (its subnormals below the block's
    scale), a = 0: about 2^-9.7;
  - int8 (block-scaled, power-of-two scale): h = 1/127: the scale puts the block's largest
    magnitude in (63.5, 127] quantization steps, so half a step is below 1/127 of it; in RMS
    terms about 2^-7 * 1.25 (kappa + 1) * crest, crest = ||m|| / ||x|| (a few for gradients).

The 1.25 covers the second-order terms (the last rounding acts on an already rounded sum).
``test_bound_covers_modelled_wires`` checks the bound against models of the encodings (int8
with arbitrary block alignment) on synthetic gradients, without processes.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from _harness import load_benchmark_module

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "wire_accuracy.py"
WIRES = ("none", "bf16", "fp16", "int8")
STEPS = 4
RUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One launch of the script over every wire dtype: a tiny model, a few steps (DDP's first
    step reduces the whole model in one bucket of ~80 KB, a ring all-reduce; the later steps
    in buckets of ~40 KB, recursive doubling)."""
    out = tmp_path_factory.mktemp("wire_accuracy") / "run"
    cmd = [
        sys.executable, str(SCRIPT), "--wires", *WIRES, "--out", str(out), "--no-plot",
        "--steps", str(STEPS), "--eval-every", "2", "--eval-batches", "4", "--batch", "4",
        "--context", "32", "--dim", "32", "--layers", "1", "--heads", "2", "--bucket-mb", "0.04",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks: a session of their own
        output, _ = proc.communicate()
        pytest.fail(f"wire_accuracy.py ran past {RUN_TIMEOUT_S} s:\n{output.decode()[-4000:]}")
    text = output.decode(errors="replace")
    assert proc.returncode == 0, f"wire_accuracy.py exited {proc.returncode}:\n{text[-6000:]}"
    with open(str(out) + ".json") as f:
        res = json.load(f)
    assert (Path(str(out) + ".md")).read_text().count("\n| ") == 1 + len(WIRES)
    return res


def run_of(result: dict[str, Any], wire: str) -> dict[str, Any]:
    run = result["runs"][wire]
    assert run["status"] == "ok", f"wire {wire}: {run}"
    return run


@pytest.mark.parametrize("wire", WIRES)
def test_wire_on_real_gradients(result: dict[str, Any], wire: str) -> None:
    run = run_of(result, wire)
    base = result["runs"]["none"]
    problems = []
    losses = run["loss"] + run["eval_loss"]
    if len(run["loss"]) != STEPS or not all(math.isfinite(v) for v in losses):
        problems.append(f"losses {losses}")
    for step, (a, b) in enumerate(zip(run["loss"], base["loss"])):
        if abs(a - b) > 0.02 * b:
            problems.append(f"step {step}: loss {a} against float32's {b}")
    if not run["params_identical"]:
        problems.append("the parameters differ between ranks")
    rec = run["allreduce"]
    n = len(rec["step"])
    sizes = set(rec["numel"])
    if n < STEPS or len(sizes) < 2 or max(sizes) * 4 <= 64 << 10:
        problems.append(f"{n} all-reduces of {sorted(sizes)} elements: not both algorithms")
    for i in range(n):
        where = f"step {rec['step'][i]} bucket {rec['bucket'][i]} ({rec['numel'][i]} elements)"
        err, bound = rec["rel_l2"][i], rec["bound"][i]
        if not rec["identical"][i]:
            problems.append(f"{where}: results differ between ranks")
        if bound is None or not err <= bound:
            problems.append(f"{where}: relative L2 error {err:.3e} above the bound {bound}")
        if wire != "none" and not err > 0:
            problems.append(f"{where}: no error at all: is the wire dtype in effect?")
    assert not problems, f"wire {wire}:\n" + "\n".join(problems[:20])


# ---------------------------------------------------------------- the bound itself


def blocks_of(x: torch.Tensor, offset: int, block: int) -> tuple[torch.Tensor, int]:
    """x padded in front by `offset` zeros and at the end to whole blocks, as (blocks, block)."""
    n = x.numel()
    total = (offset + n + block - 1) // block * block
    padded = torch.zeros(total, dtype=torch.float32)
    padded[offset : offset + n] = x
    return padded.view(-1, block), n


def block_scaled(x: torch.Tensor, offset: int, encode: Any, top: float) -> torch.Tensor:
    """x through a block-scaled encoding: each block of 256 (starting `offset` elements before
    x) scaled by the power of two that puts its largest magnitude in (top / 2, top]."""
    b, n = blocks_of(x, offset, 256)
    amax = b.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / top))), 1.0)
    out = encode(b / scale) * scale
    return out.reshape(-1)[offset : offset + n]


def int8_wire(x: torch.Tensor, offset: int) -> torch.Tensor:
    return block_scaled(x, offset, lambda v: v.round().clamp(-127, 127), 127.0)


def fp16_wire(x: torch.Tensor, offset: int) -> torch.Tensor:
    return block_scaled(x, offset, lambda v: v.half().float(), 65504.0)


MODEL_WIRES = {
    "bf16": lambda x, off: x.to(torch.bfloat16).float(),
    "fp16": fp16_wire,
    "int8": int8_wire,
}


def test_bound_covers_modelled_wires() -> None:
    """On synthetic gradients (magnitudes over 6 decades, outliers, the nodes' partials partly
    cancelling), a model of each encoding in both 2-node algorithms (ring: one partial rounded
    per block; recursive doubling: both; then the sum) stays within error_bound, and the bound
    is no more than 20x the error (it says something)."""
    wa = load_benchmark_module("wire_accuracy")
    g = torch.Generator().manual_seed(7)
    n = 20_000
    problems = []
    for trial in range(6):
        shared = 1e-4 * torch.randn(n, generator=g) * torch.exp(1.5 * torch.randn(n, generator=g))
        # what one node adds, the other mostly takes away: kappa up to ~5
        noise = torch.randn(n, generator=g) * shared.norm() / math.sqrt(n) * trial
        p = [(shared + noise).float(), (shared - 0.9 * noise).float()]
        p[0][torch.randint(0, n, (5,), generator=g)] *= 30.0  # outliers
        exact = p[0].double() + p[1].double()
        offset = int(torch.randint(0, 256, (1,), generator=g))
        for wire, q in MODEL_WIRES.items():
            bound = wa.error_bound(wire, [x.double() for x in p], exact)
            half = n // 2  # the ring: each node owns one half and rounds the other's partial
            ring = torch.cat(
                [q(p[0], offset)[:half] + p[1][:half], p[0][half:] + q(p[1], offset)[half:]]
            )
            doubling = q(p[0], offset) + q(p[1], offset)
            for name, summed in (("ring", ring), ("doubling", doubling)):
                err = float((q(summed, offset).double() - exact).norm() / exact.norm())
                if not (bound / 20 <= err <= bound):
                    problems.append(
                        f"{wire} {name} trial {trial}: error {err:.3e}, bound {bound:.3e}"
                    )
    assert not problems, "\n".join(problems)


def test_block_max_norm_covers_any_alignment() -> None:
    """||m|| of block_max_norm is at least that of the true block maxima, wherever the blocks
    start."""
    wa = load_benchmark_module("wire_accuracy")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5000, generator=g, dtype=torch.float64) * torch.exp(
        3.0 * torch.randn(5000, generator=g, dtype=torch.float64)
    )
    got = wa.block_max_norm(x)
    for offset in (0, 1, 100, 255):
        b, n = blocks_of(x.float(), offset, 256)
        m = b.abs().amax(dim=1, keepdim=True).expand_as(b).reshape(-1)[offset : offset + n]
        assert float(m.double().norm()) <= got * (1 + 1e-6), offset
