"""fastcomm's flight recorder, seen from Python: dumps on demand.

Each fastcomm group keeps its last ``FASTCOMM_TRACE_BUFFER_SIZE`` collectives and
point-to-point ops (default 2000; ``0`` turns it off), with sequence numbers, sizes, dtypes,
reduce op, root or peer and state. A rank writes its dump to
``<FASTCOMM_TRACE_FILE><global rank>`` (default ``/tmp/fastcomm_trace_rank_<rank>``) when one of
its collectives times out or fails (and then asks every other rank to dump too), on
``FASTCOMM_TRACE_SIGNAL``, or when :func:`dump_trace` is called. The dumps are in the pickle
format of PyTorch's flight recorder; ``python -m torchext.trace_analysis <dir>`` names the rank
that hangs. See docs/debugging.md.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch.distributed as dist

from torchext import _C
from torchext._registration import BACKEND_NAME

__all__ = ["dump_trace"]


def dump_trace(path: Optional[Union[str, os.PathLike]] = None) -> str:
    """Writes this process's flight recorder dump: the recorded ops of every live fastcomm
    group of the process, in PyTorch's flight recorder format.

    Args:
        path: the file to write; default ``<FASTCOMM_TRACE_FILE><global rank>``, the file a
            timeout or a signal writes, where ``python -m torchext.trace_analysis`` and
            ``torchfrtrace`` look for every rank's dump.

    Returns:
        The path written.

    Raises:
        RuntimeError: no fastcomm group records (none exists, or every one was created with
            ``FASTCOMM_TRACE_BUFFER_SIZE=0``), or the file cannot be written.
    """
    written = _C._dump_trace("" if path is None else os.fspath(path), "on demand")
    if not written:
        raise RuntimeError(
            "fastcomm: no process group records a trace: create the group with "
            "FASTCOMM_TRACE_BUFFER_SIZE > 0 (the default is 2000)"
        )
    return written


def _declare_self_recording() -> None:
    """fastcomm records its own ops, as gloo and nccl do: torch versions that attach their
    c10d flight recorder hook to out-of-tree backends would otherwise record every fastcomm op a
    second time, at tens of microseconds per collective (benchmarks/bench_trace.py)."""
    backends = getattr(dist.distributed_c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if isinstance(backends, set):
        backends.add(BACKEND_NAME)
