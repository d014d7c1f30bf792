"""DDP communication hooks that can be captured into a CUDA graph with fastcomm.

``allreduce_hook``, ``bf16_compress_hook`` and ``fp16_compress_hook`` have the
standard signature ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``
and the numerics of ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``:

- ``allreduce_hook`` divides the bucket by the world size, then sums it over the
  ranks in place: DDP's default reduction;
- ``bf16_compress_hook`` / ``fp16_compress_hook`` cast the bucket to the 16-bit
  type, divide by the world size (before the sum, so fp16 does not overflow),
  sum that over the ranks and write the result back into the bucket.

``state`` is None (the default group), a process group, or an object with a
``process_group`` attribute. Any backend works (fastcomm, NCCL, Gloo, CPU or CUDA
tensors). The result is always written into ``bucket.buffer()`` and that very
tensor is the future's value, so with ``gradient_as_bucket_view=True`` DDP copies
nothing afterwards.

**CUDA graphs.** With CUDA tensors on fastcomm (or NCCL) a hook does nothing the
capture forbids: no host synchronisation, no event query, no allocation outside
the caching allocator (the compressed copy comes from it, i.e. from the graph's
private pool while capturing), and the future it returns is already complete when
the hook returns. The all-reduce runs on the backend's communication stream,
which waits for the caller's stream; the rest of the hook (writing the result
back) runs on the stream CUDA-aware futures hand their callbacks, after the
all-reduce. So the reduction of a bucket overlaps the backward computation of
the next buckets, in eager mode and in the replayed graph alike, and DDP's final
wait on the future only orders streams. A backend whose future would complete
later on the host cannot be captured: the hook then raises instead of recording
a graph that waits for nothing.

    ddp = DistributedDataParallel(model, static_graph=True, gradient_as_bucket_view=True)
    ddp.register_comm_hook(None, torchext.hooks.bf16_compress_hook)

See ``examples/ddp_cuda_graph.py`` for a whole training step captured with
``torch.cuda.graph``.
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook compares
# the annotations of ``bucket`` and of the return value with the real types.
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["allreduce_hook", "bf16_compress_hook", "fp16_compress_hook"]


def _group(state: Any) -> dist.ProcessGroup:
    """The process group a hook state names (None: the default group)."""
    if state is None:
        group = dist.group.WORLD
    elif isinstance(state, dist.ProcessGroup):
        group = state
    elif hasattr(state, "process_group"):
        group = state.process_group if state.process_group is not None else dist.group.WORLD
    else:
        raise TypeError(
            "torchext.hooks: state must be None, a ProcessGroup or an object with a "
            f"process_group attribute, got {type(state).__name__}"
        )
    if group is None:
        raise RuntimeError("torchext.hooks: no process group (call init_process_group first)")
    return group


def _backend_name(group: dist.ProcessGroup) -> str:
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):  # a group torch has no name for: use its type
        return type(group).__name__


def _all_reduce_into(
    group: dist.ProcessGroup,
    tensor: torch.Tensor,
    finish: Callable[[torch.Tensor], torch.Tensor],
) -> "torch.futures.Future[torch.Tensor]":
    """Sums ``tensor`` over ``group`` in place; the returned future's value is
    ``finish(tensor)``, run once the sum is there (on the callback stream of the
    backend's CUDA-aware future for CUDA tensors)."""
    capturing = tensor.is_cuda and torch.cuda.is_current_stream_capturing()
    work = dist.all_reduce(tensor, group=group, async_op=True)
    fut = work.get_future()
    if capturing and not fut.done():
        # The callback below would run on the host after the capture ended, and
        # the graph would not contain it: fail now, naming the cause.
        raise RuntimeError(
            f"torchext.hooks: the {_backend_name(group)} backend cannot be captured into a "
            "CUDA graph: the future of its all_reduce completes later on the host; use "
            "fastcomm or nccl for CUDA graphs"
        )
    return fut.then(lambda f: finish(f.value()[0]))


def allreduce_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the bucket over the group (divide by the world size, then sum), in
    place in ``bucket.buffer()``: the same result as DDP without a hook.

    Example::

        >>> ddp_model.register_comm_hook(None, torchext.hooks.allreduce_hook)
    """
    group = _group(state)
    buffer = bucket.buffer()
    # Divide first, as torch's allreduce_hook and DDP's built-in reduction do:
    # the sum of the quotients cannot overflow where the sum itself could.
    buffer.div_(group.size())
    return _all_reduce_into(group, buffer, lambda reduced: buffer)


def _compress_hook(
    dtype: torch.dtype, state: Any, bucket: dist.GradBucket
) -> "torch.futures.Future[torch.Tensor]":
    group = _group(state)
    buffer = bucket.buffer()
    # A fresh tensor from the caching allocator (the graph's pool under capture);
    # its memory stays reserved until the stream work that uses it is done.
    compressed = buffer.to(dtype).div_(group.size())

    def decompress(reduced: torch.Tensor) -> torch.Tensor:
        # In place into the bucket: no second full-size buffer, and DDP finds
        # its result where the gradients (as bucket views) already point.
        buffer.copy_(reduced)
        return buffer

    return _all_reduce_into(group, compressed, decompress)


def bf16_compress_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sums the bucket over the group in bfloat16 (each rank's bucket cast to
    bfloat16 and divided by the world size first), then writes the average back
    into ``bucket.buffer()`` in its own dtype.

    Example::

        >>> ddp_model.register_comm_hook(None, torchext.hooks.bf16_compress_hook)
    """
    return _compress_hook(torch.bfloat16, state, bucket)


def fp16_compress_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Like :func:`bf16_compress_hook` with float16: more mantissa bits, less
    range (the division by the world size comes before the sum so that the sum
    stays in range where the gradients do).

    Example::

        >>> ddp_model.register_comm_hook(None, torchext.hooks.fp16_compress_hook)
    """
    return _compress_hook(torch.float16, state, bucket)
