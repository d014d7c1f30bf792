"""Registers the c10d backend "fastcomm" with torch.distributed.

Entry points (chosen by setup.py for the torch it builds against) make
``init_process_group(backend="fastcomm")`` work without ``import torchext``:
torch >= 2.14 calls :func:`register` through the ``torch.distributed.backends``
group when the name is first used; older torch only offers the device autoload
group ``torch.backends``, which calls :func:`autoload` at ``import torch``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

BACKEND_NAME = "fastcomm"
_registered = False


def _create_backend(dist_backend_opts: Any, backend_options: Any) -> Any:
    from torchext import _C

    timeout = dist_backend_opts.timeout
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    global_ranks = list(getattr(dist_backend_opts, "global_ranks_in_group", []) or [])
    group_id = str(getattr(dist_backend_opts, "group_id", "") or "")
    return _C.ProcessGroupFastComm(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        timeout,
        global_ranks,
        group_id,
    )


class _SplitOptions:
    """``backend.options`` as torch 2.11's ``split_group`` uses it: it deep-copies
    the parent backend's options, and ``Backend.Options`` cannot be deep-copied there,
    so the copy is made by the backend."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def __deepcopy__(self, memo: dict) -> Any:
        return self._backend._copy_options()


def _add_split_options() -> None:
    from torchext import _C

    if not hasattr(_C.ProcessGroupFastComm, "options"):
        _C.ProcessGroupFastComm.options = property(_SplitOptions)


def register() -> None:
    """Register "fastcomm" for CPU and CUDA tensors (idempotent)."""
    global _registered
    if _registered:
        return
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    _add_split_options()
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(
            BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
        )
    _registered = True


def autoload() -> None:
    """Hook for torch's device-backend autoload (torch < 2.14): registers now."""
    register()
