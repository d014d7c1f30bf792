"""fastcomm: a torch.distributed backend ("fastcomm"), fused matmul ops and DDP hooks.

``import torchext`` registers the c10d backend ``"fastcomm"`` for CPU and CUDA
tensors; ``torch.distributed.init_process_group(backend="fastcomm")`` then works
under torchrun.
"""

from __future__ import annotations

from typing import Any, Optional

import torch  # noqa: F401  (loads libtorch before our extension)
import torch.distributed as dist

from torchext import _C
from torchext import hooks, nn, ops  # noqa: F401  (ops.py registers fake kernels and autograd)
from torchext._registration import BACKEND_NAME, register
from torchext.flight_recorder import _declare_self_recording, dump_trace

__version__ = "0.1.0"
__all__ = [
    "BACKEND_NAME",
    "register",
    "stats",
    "reset_stats",
    "has_cuda",
    "nccl_version",
    "timeline",
    "save_timeline",
    "dump_trace",
    "ops",
    "nn",
    "hooks",
]

register()
_declare_self_recording()


def has_cuda() -> bool:
    """True when the extension was built with CUDA (NCCL) support."""
    return bool(_C.has_cuda())


def nccl_version() -> Optional[tuple[int, int, int]]:
    """(major, minor, patch) of the NCCL fastcomm was compiled against, or None."""
    v = _C.nccl_version()
    return None if v is None else tuple(v)  # type: ignore[return-value]


def _backend(group: Optional[dist.ProcessGroup]) -> Any:
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    backend = pg._get_backend(torch.device("cpu"))
    if not isinstance(backend, _C.ProcessGroupFastComm):
        raise ValueError(f"group uses backend {type(backend).__name__}, not fastcomm")
    return backend


def stats(group: Optional[dist.ProcessGroup] = None) -> dict[str, dict[str, float]]:
    """Per-collective statistics of a fastcomm group (default: the world group).

    Returns ``{collective: {"count", "bytes", "time_us"}}`` where ``bytes`` is the
    size of the local input per call, summed, and ``time_us`` the time the
    collective spent running: host time on CPU; on CUDA, GPU time between a
    pair of timing events, recorded only with ``FASTCOMM_CUDA_TIMING=1`` (they
    cost GPU time, so by default CUDA collectives count calls and bytes only).
    With ``FASTCOMM_CUDA_INTER=host``, the key ``cuda_via_host`` also counts the CUDA
    collectives staged through host memory across nodes. The keys ``nvlink_one_shot`` and
    ``nvlink_two_shot`` count the CUDA all_reduces, ``nvlink_all_gather`` and
    ``nvlink_reduce_scatter`` the all_gathers and reduce_scatters, that ran on fastcomm's NVLink
    kernels inside a node (each also counted under its collective; a captured one once, at its
    capture).
    """
    return _backend(group).stats()


def reset_stats(group: Optional[dist.ProcessGroup] = None) -> None:
    """Zero the statistics of a fastcomm group (default: the world group)."""
    _backend(group).reset_stats()


def timeline() -> list[dict[str, Any]]:
    """The pipeline phases recorded since the last call (needs ``FASTCOMM_TIMELINE=1``
    when the group is created): dicts with ``name``, ``thread``, ``chunk``,
    ``start_us`` and ``end_us`` (microseconds on one clock per process)."""
    return [
        {"name": n, "thread": t, "chunk": c, "start_us": s, "end_us": e}
        for n, t, c, s, e in _C._timeline()
    ]


def save_timeline(path: str, events: Optional[list[dict[str, Any]]] = None) -> int:
    """Writes ``events`` (default: :func:`timeline`) as a Chrome trace (open it in
    chrome://tracing or Perfetto): one row per thread, so overlapping phases show
    side by side. Returns the number of events written."""
    import json
    import os

    events = timeline() if events is None else events
    rank = dist.get_rank() if dist.is_initialized() else 0
    threads = sorted({e["thread"] for e in events})
    trace = [
        {
            "name": e["name"],
            "cat": "fastcomm",
            "ph": "X",
            "pid": rank,
            "tid": threads.index(e["thread"]),
            "ts": e["start_us"],
            "dur": max(0, e["end_us"] - e["start_us"]),
            "args": {"chunk": e["chunk"]},
        }
        for e in events
    ]
    trace += [
        {"name": "thread_name", "ph": "M", "pid": rank, "tid": i, "args": {"name": t}}
        for i, t in enumerate(threads)
    ]
    with open(os.fspath(path), "w") as f:
        json.dump({"traceEvents": trace}, f)
    return len(events)
