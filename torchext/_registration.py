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


def _never_split_from_fastcomm() -> None:
    """A new group of any backend asks torch's ``_get_split_source`` for a communicator of the
    default group to split from. Some torch versions answer with the bound device's backend
    whatever backend the new group asks for, so ``new_group(backend="nccl")`` under a fastcomm
    default group bound to a device hands ProcessGroupNCCL a ProcessGroupFastComm to split
    from, and it raises. Every fastcomm group makes its own communicator from the store, so
    a fastcomm group is never a split source."""
    import torch.distributed.distributed_c10d as c10d

    from torchext import _C

    original = getattr(c10d, "_get_split_source", None)
    if original is None or getattr(original, "_fastcomm_filtered", False):
        return

    def get_split_source(*args: Any, **kwargs: Any) -> Any:
        source = original(*args, **kwargs)
        return None if isinstance(source, _C.ProcessGroupFastComm) else source

    get_split_source._fastcomm_filtered = True  # type: ignore[attr-defined]
    c10d._get_split_source = get_split_source


def register() -> None:
    """Register "fastcomm" for CPU and CUDA tensors (idempotent)."""
    global _registered
    if _registered:
        return
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    _add_split_options()
    _never_split_from_fastcomm()
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(
            BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
        )
    _registered = True


def autoload() -> None:
    """Hook for torch's device-backend autoload (torch < 2.14): registers now."""
    register()
