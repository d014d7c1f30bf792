"""Fixtures and markers of the fastcomm test suite.

- ``@pytest.mark.cuda(world_size=N)`` (or ``cuda(N)``): skipped unless
  ``torch.cuda.device_count() >= N`` (default N = 2; one GPU per rank). The closest mark
  counts, so a parameter's ``cuda(2)`` overrides a module-wide ``cuda(4)``.
- Shared-memory hygiene: ``/dev/shm/fastcomm*`` entries that appear during the session
  and are still there at its end fail the session (each is attributed to the test after
  which it was first seen).
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import BACKEND

SHM_PATTERN = "/dev/shm/fastcomm*"

_shm_new: dict[str, str] = {}  # leaked path -> test after which it was first seen
_gpu_count: int | None = None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda(world_size=2): needs one CUDA GPU per rank")
    config.addinivalue_line("markers", "slow: long-running")


def pytest_report_header(config: pytest.Config) -> str:
    return f"fastcomm tests: backend under test = {BACKEND!r} (FASTCOMM_TEST_BACKEND)"


def _cuda_device_count() -> int:
    global _gpu_count
    if _gpu_count is None:
        try:
            import torch

            _gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception:
            _gpu_count = 0
    return _gpu_count


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("cuda")
    if marker is not None:
        need = marker.kwargs.get("world_size", marker.args[0] if marker.args else 2)
        have = _cuda_device_count()
        if have < need:
            pytest.skip(f"needs {need} CUDA GPU(s), found {have}")


def _creator_alive(path: str) -> bool:
    """Segments are named /fastcomm-[<kind>-]<pidns>-<creator pid>-...: one whose creator
    still runs belongs to a live group (possibly another test session on this machine)."""
    numbers = [p for p in os.path.basename(path).split("-")[1:] if p.isdigit()]
    try:
        os.kill(int(numbers[1]), 0)
    except (IndexError, ValueError, OverflowError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def _shm_entries() -> set[str]:
    return {p for p in glob.glob(SHM_PATTERN) if not _creator_alive(p)}


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shared_memory() -> Iterator[None]:
    """Fail the session if /dev/shm/fastcomm* entries created during it remain after
    their creator exited (live ones may belong to a concurrent session)."""
    before = _shm_entries()
    yield
    leaked = sorted(_shm_entries() - before)
    if leaked:
        lines = [f"  {p} (first seen after {_shm_new.get(p, '?')})" for p in leaked]
        for p in leaked:  # do not let one leak poison the next run
            try:
                os.unlink(p)
            except OSError:
                pass
        pytest.fail(
            f"{len(leaked)} shared-memory entr(y/ies) matching {SHM_PATTERN} left behind by "
            f"the test session (removed now):\n" + "\n".join(lines),
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def _attribute_shm_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    before = _shm_entries()
    yield
    for p in _shm_entries() - before:
        _shm_new.setdefault(p, request.node.nodeid)
