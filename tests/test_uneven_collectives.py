"""all_gather and reduce_scatter with a different size on every rank (what NCCL offers as
all_gather_v and reduce_scatter_v), against references computed from every rank's inputs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _harness import BACKEND, run_ranks


def _data(rank: int, sizes: list[int], salt: int) -> list[torch.Tensor]:
    """Integer-valued floats (sums are exact in any order), one tensor per share."""
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return [torch.randint(-50, 50, (n, 3), generator=g).float() for n in sizes]


def uneven_fn(rank: int, world: int, device: str) -> None:
    if device == "cuda":
        torch.cuda.set_device(rank)
    sizes = [2 * r + 1 for r in range(world)]
    for async_op in (False, True):
        # all_gather: output r is rank r's input
        inputs = [_data(r, [sizes[r]], 1)[0] for r in range(world)]
        out = torch.full((sum(sizes), 3), float("nan"), device=device)
        work = dist.all_gather(
            list(torch.split(out, sizes)), inputs[rank].to(device), async_op=async_op
        )
        if async_op:
            work.wait()
        torch.testing.assert_close(out.cpu(), torch.cat(inputs), rtol=0, atol=0)

        # reduce_scatter: share r of every rank, reduced into rank r; inputs left as given
        for op, reduce in ((dist.ReduceOp.SUM, torch.sum), (dist.ReduceOp.MAX, torch.amax)):
            everyone = [_data(r, sizes, 2) for r in range(world)]
            mine = [t.to(device) for t in everyone[rank]]
            given = [t.clone() for t in mine]
            result = torch.full((sizes[rank], 3), float("nan"), device=device)
            work = dist.reduce_scatter(result, given, op=op, async_op=async_op)
            if async_op:
                work.wait()
            expected = reduce(torch.stack([everyone[r][rank] for r in range(world)]), dim=0)
            torch.testing.assert_close(result.cpu(), expected, rtol=0, atol=0)
            for g, m in zip(given, mine):
                torch.testing.assert_close(g, m, rtol=0, atol=0)


@pytest.mark.skipif(BACKEND == "gloo", reason="gloo: all_gather needs the same size on every rank")
@pytest.mark.parametrize(
    "device, world",
    [("cpu", 3), pytest.param("cuda", 2, marks=pytest.mark.cuda(world_size=2))],
)
def test_uneven_all_gather_and_reduce_scatter(device: str, world: int) -> None:
    run_ranks(world, uneven_fn, device, timeout_s=180)
