"""DDP training parity: the backend under test vs a reference backend (gloo on CPU, NCCL on
CUDA), same seed, same data, N steps: per-step losses and final parameters must agree
within 1e-6. Both DDP runs also match a communication-free local reference (1e-5)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _harness import BACKEND, run_ranks

STEPS = 5
PARITY_TOL = 1e-6
REFERENCE_TOL = 1e-5


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.BatchNorm1d(32),  # a buffer: DDP broadcasts buffers from rank 0 every forward
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.Tanh(),
        nn.Linear(32, 4),
    )


# Scaled so targets (and losses) are O(1): the 1e-6 parity bound is then several float32
# ulps, whatever order a backend sums the gradients in.
_TEACHER = 0.25 * torch.randn(16, 4, generator=torch.Generator().manual_seed(99))


def _batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh inputs per (step, rank); targets from a fixed linear teacher (learnable)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=g)
    y = x @ _TEACHER + 0.01 * torch.randn(8, 4, generator=g)
    return x.to(device), y.to(device)


def _train_ddp(
    module: nn.Module, group: Any, device: torch.device, rank: int
) -> tuple[list[float], nn.Module]:
    kw: dict[str, Any] = {"device_ids": [device.index]} if device.type == "cuda" else {}
    # tiny buckets: several all_reduces per step once buckets are rebuilt after step 1
    ddp = DDP(module, process_group=group, bucket_cap_mb=0.002, **kw)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, rank, device)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, ddp.module


def _train_local_reference(
    ws: int, device: torch.device, rank: int
) -> tuple[list[float], nn.Module]:
    """No communication: the mean over ranks of the per-rank losses has the gradient DDP
    computes (the average of the per-rank gradients). BatchNorm uses each rank's own
    batch statistics, as it does under DDP."""
    model = _model(1234).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        per_rank = []
        for r in range(ws):
            x, y = _batch(step, r, device)
            per_rank.append(nn.functional.mse_loss(model(x), y))
        (sum(per_rank) / ws).backward()
        opt.step()
        losses.append(per_rank[rank].item())
    return losses, model


def ddp_parity_fn(rank: int, ws: int, device_type: str, other_backend: str) -> dict[str, Any]:
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    other = dist.new_group(backend=other_backend)
    # Every rank starts from DIFFERENT weights: DDP must broadcast rank 0's at construction.
    start = _model(1234 + rank).to(device)
    losses_t, model_t = _train_ddp(copy.deepcopy(start), None, device, rank)  # under test
    losses_o, model_o = _train_ddp(copy.deepcopy(start), other, device, rank)  # reference PG
    losses_l, model_l = _train_local_reference(ws, device, rank)

    errors = []

    def close(a: Any, b: Any, tol: float, what: str) -> None:
        try:
            torch.testing.assert_close(a, b, rtol=0, atol=tol)
        except AssertionError as e:
            errors.append(f"{what}: {e}")

    close(torch.tensor(losses_t), torch.tensor(losses_o), PARITY_TOL, "per-step losses")
    for (n, p_t), (_, p_o), (_, p_l) in zip(
        model_t.named_parameters(), model_o.named_parameters(), model_l.named_parameters()
    ):
        close(p_t.detach().cpu(), p_o.detach().cpu(), PARITY_TOL, f"final param {n}")
        close(p_t.detach().cpu(), p_l.detach().cpu(), REFERENCE_TOL, f"param {n} vs local ref")
        close(
            p_o.detach().cpu(),
            p_l.detach().cpu(),
            REFERENCE_TOL,
            f"reference-PG param {n} vs local ref",
        )
    for (n, b_t), (_, b_o) in zip(model_t.named_buffers(), model_o.named_buffers()):
        close(b_t.detach().cpu().double(), b_o.detach().cpu().double(), PARITY_TOL, f"buffer {n}")
    close(torch.tensor(losses_t), torch.tensor(losses_l), REFERENCE_TOL, "losses vs local ref")
    # the parameters are identical on every rank (gathered through the reference group)
    flat = torch.cat([p.detach().reshape(-1) for p in model_t.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(ws)]
    dist.all_gather(gathered, flat, group=other)
    for r in range(ws):
        if not torch.equal(gathered[r], flat):
            errors.append(f"parameters differ between rank {rank} and rank {r}")
    if errors:
        raise AssertionError(f"rank {rank} ({BACKEND} vs {other_backend}):\n" + "\n".join(errors))
    return {"losses": losses_t}


@pytest.mark.parametrize(
    "device_type,other_backend",
    [
        pytest.param("cpu", "gloo", id="cpu-vs-gloo"),
        pytest.param("cuda", "nccl", id="cuda-vs-nccl", marks=pytest.mark.cuda(world_size=2)),
    ],
)
def test_ddp_parity(device_type: str, other_backend: str) -> None:
    res = run_ranks(2, ddp_parity_fn, device_type, other_backend, timeout_s=180)
    # the loss (mean over ranks) actually went down: the test trains something
    first = sum(r["losses"][0] for r in res) / len(res)
    last = sum(r["losses"][-1] for r in res) / len(res)
    assert last < first, res


def ddp_logging_fn(rank: int, ws: int) -> dict[str, str]:
    model = DDP(nn.Linear(4, 4))
    pg = dist.group.WORLD
    return {
        "ddp_logging_data": model._get_ddp_logging_data().get("backend_name"),
        "process_group": pg.name(),
        "dist.get_backend": dist.get_backend(),
        "backend": pg._get_backend(torch.device("cpu")).name(),
    }


@pytest.mark.skipif(BACKEND != "fastcomm", reason="checks how torch names a plugin backend")
def test_ddp_logging_names_plugins_custom() -> None:
    """DDP's logging data takes ``backend_name`` from ProcessGroup::getBackendName(), which c10d
    derives from the group's BackendType; every plugin backend is BackendType.CUSTOM, so DDP
    logs "custom" for fastcomm (as for any third-party backend) while dist.get_backend() and
    the backend itself say "fastcomm". Should torch start naming plugins, this test fails."""
    for names in run_ranks(2, ddp_logging_fn, timeout_s=120):
        assert names == {
            "ddp_logging_data": "custom",
            "process_group": "custom",
            "dist.get_backend": "fastcomm",
            "backend": "fastcomm",
        }, names
