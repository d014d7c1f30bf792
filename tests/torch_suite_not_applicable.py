"""Tests of PyTorch's DistributedTest suite that do not apply to fastcomm, each with the reason.

tests/torch_suite.py does not run these and counts them apart. Only tests of something fastcomm
cannot be or do belong here: another backend's own API or internals, a fact c10d fixes for
every backend registered from outside torch, or a test that fails the same way on the stock
backend (``tests/torch_suite.py --stock`` shows it). A test of an API fastcomm should support is
a failure to fix, not an entry here. Keys are test names or globs of them.
"""

from __future__ import annotations

_MONITORED_BARRIER = (
    "monitored_barrier is a GLOO-only API: torch documents it so, and c10d's "
    "Backend::monitoredBarrier is implemented by ProcessGroupGloo alone (every other backend "
    "raises 'does not support monitoredBarrier, only GLOO supports monitored barrier')"
)

#: on --device cpu
CPU: dict[str, str] = {
    "test_monitored_barrier_gloo": _MONITORED_BARRIER,
    "test_monitored_barrier_gloo_subgroup": _MONITORED_BARRIER,
    "test_monitored_barrier_gloo_rank_0_timeout": _MONITORED_BARRIER,
    "test_monitored_barrier_failure_order": _MONITORED_BARRIER,
    "test_monitored_barrier_wait_all_ranks": _MONITORED_BARRIER,
    "test_ddp_logging_data_cpu": (
        "checks that DDP's logging data names the backend as dist.get_backend() does "
        "('fastcomm'); c10d records ProcessGroup::getBackendName(), which is 'custom' for every "
        "backend registered through Backend.register_backend (BackendType::CUSTOM), and a "
        "backend cannot change it"
    ),
}

#: on --device cuda
CUDA: dict[str, str] = {
    "test_nccl_high_priority_stream": (
        "builds a dist.ProcessGroupNCCL itself, with ProcessGroupNCCL.Options: a test of NCCL's "
        "own process group class"
    ),
    "test_DistributedDataParallel": (
        "fails with NCCL itself on torch 2.11 with the same 'Tensor-likes are not close' "
        "(--stock, 2x H200); torch 2.15 skips it on Linux (pytorch/pytorch#77317)"
    ),
    "test_ddp_profiling_execution_trace": (
        "asserts dist.get_backend() == 'nccl' and checks the record_param_comms nodes that "
        "ProcessGroupNCCL inserts into the execution trace"
    ),
}


def for_device(device: str) -> dict[str, str]:
    """The entries that apply to a run on `device` ("cpu" or "cuda")."""
    return dict(CPU if device == "cpu" else CUDA)
