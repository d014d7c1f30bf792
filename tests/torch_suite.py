"""PyTorch's own distributed test suite, run against the fastcomm backend.

``torch/testing/_internal/distributed/distributed_test.py`` holds
``DistributedTest._DistTestBase``, the suite PyTorch runs for gloo and NCCL
(test/distributed/test_distributed_spawn.py): every test spawns WORLD_SIZE fresh processes that
join one process group of the backend named by the environment variable BACKEND. This runner
points it at "fastcomm":

    python tests/torch_suite.py --device cpu                # CPU tensors, 3 ranks
    python tests/torch_suite.py --device cuda --jobs 6      # CUDA tensors, 2 ranks, 2 GPUs
    python tests/torch_suite.py --device cpu -k all_gather -k barrier --json out.json

How the suite is pointed at fastcomm. The suite reads BACKEND once, at import, and decides per
test whether it applies: by membership in ``DistTestCases`` feature sets, and by comparing BACKEND
with the names of the stock backends ("gloo" gates the CPU variants, "nccl" the CUDA ones, "mpi"
the CPU all_to_all tests). Those comparisons are about the backend's capabilities, which fastcomm
has on both devices, so the suite's BACKEND is a ``SuiteBackend``: the string "fastcomm" (what
every test sees through ``dist.get_backend()``, messages and ``init_process_group``), which also
compares equal to the stock backends whose test paths fastcomm takes on the chosen device: gloo
and MPI on CPU, NCCL on CUDA. The feature sets name fastcomm where it has the feature, and the
profiling allowlists name it (every fastcomm Work carries a "fastcomm:<op>" profiler title).
Tests of another backend's own API or internals, and DDP's recorded backend name, are listed in
tests/torch_suite_not_applicable.py with the reason; they are not run and are counted apart.

``--jobs N`` runs N workers, each a process of its own that runs one test at a time with its own
temporary directory (the suite's TEMP_DIR, barrier files and file:// rendezvous live there, so
no TCP port is shared); tests are handed to whichever worker is free. A worker that dies or
exceeds the test timeout is replaced, and its test counted as failed. ``--start fork`` forks the
ranks from the worker instead of spawning them (CPU only; a second a test instead of ~15 on two
cores). ``--stock`` runs the selected tests on the stock backend of the device instead (gloo on
CPU, NCCL on CUDA), unchanged and without the not-applicable list: a test that fails there too
fails on its own (or on this machine), not on fastcomm. Exit status: 0 when no test failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import importlib.util
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from collections.abc import Iterable, Sequence
from typing import Any

SUITE_MODULE = "torch.testing._internal.distributed.distributed_test"
BACKEND_NAME = "fastcomm"
DEVICES = ("cpu", "cuda")
DEFAULT_WORLD = {"cpu": 3, "cuda": 2}

#: The stock backends whose test paths fastcomm takes, per device.
STANDS_FOR = {"cpu": ("gloo", "mpi"), "cuda": ("nccl",)}

#: DistTestCases.backend_feature entries fastcomm has on both devices: CUDA tensors ("gpu"),
#: DDP communication hooks on CUDA ("cuda"), DDP, subgroups, and "plugin" (a backend
#: registered through Backend.register_backend, which require_backend_is_available accepts).
FEATURES = ("gpu", "cuda", "ddp", "subgroup", "plugin")

#: DistTestCases.skip_collective entries fastcomm supports, per device (recv from any source
#: is CPU-only in fastcomm, so on CUDA it keeps NCCL's skip).
COLLECTIVES = {
    "cpu": ("allgather_coalesced", "reduce", "sendrecv anysource", "cpu barrier"),
    "cuda": ("allgather_coalesced", "reduce", "cpu barrier"),
}

#: Module-level allowlists of the suite that name the backends whose profiler events it checks.
PROFILING_LISTS = (
    "PROFILING_SUPPORTED_BACKENDS",
    "CUDA_PROFILING_SUPPORTED_BACKENDS",
    "SEND_RECV_PROFILING_SUPPORTED_BACKENDS",
)

#: Environment of the run, read by workers and by the ranks they spawn.
DEVICE_ENV = "FASTCOMM_SUITE_DEVICE"
START_ENV = "FASTCOMM_SUITE_START"
STOCK_ENV = "FASTCOMM_SUITE_STOCK"  # "1": the stock backend of the device instead of fastcomm

#: The class name under which the suite's tests are run (and unpickled in the spawned ranks).
TEST_CLASS = "TestFastCommDist"

#: Tests that cover each collective API on CPU (all_reduce and its coalesced form,
#: all_gather in its forms and the object collectives, reduce, all_to_all, gather, scatter,
#: broadcast, barrier and its timeout, point-to-point including batches and wildcard
#: receives, subgroups, sparse all_reduce, DDP with hooks and futures). test_torch_suite.py
#: requires each of these to pass, not only to not fail: a suite that skips them on fastcomm
#: would otherwise look green.
CORE_TESTS = (
    "test_get_backend",
    "test_get_rank_size_group",
    "test_destroy_group",
    "test_all_reduce_sum",
    "test_all_reduce_sum_async",
    "test_all_reduce_sum_complex",
    "test_all_reduce_full_group_product",
    "test_all_reduce_coalesced_sum",
    "test_sparse_all_reduce_sum",
    "test_all_gather",
    "test_all_gather_full_group",
    "test_all_gather_coalesced_simple",
    "test_all_gather_object_subgroup",
    "test_reduce_sum",
    "test_all_to_all",
    "test_all_to_all_single_unequal_split",
    "test_gather",
    "test_scatter",
    "test_scatter_object_list",
    "test_broadcast",
    "test_barrier",
    "test_barrier_timeout_full_group",
    "test_send_recv",
    "test_isend",
    "test_irecv",
    "test_send_recv_any_source",
    "test_batch_isend_irecv_gloo",
    "test_DistributedDataParallelCPU",
    "test_ddp_create_graph",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_get_future",
)


class SuiteBackend(str):
    """The suite's BACKEND: the string "fastcomm" that also equals the names in ``stands_for``.

    Hashes like ``stands_for[0]``, so ``BACKEND in {"gloo"}`` holds on CPU as ``BACKEND ==
    "gloo"`` does; ``lower()``, formatting and ``dist.Backend(BACKEND)`` give plain "fastcomm".
    """

    stands_for: tuple[str, ...]

    def __new__(cls, stands_for: Sequence[str]) -> SuiteBackend:
        self = super().__new__(cls, BACKEND_NAME)
        self.stands_for = tuple(stands_for)
        return self

    def __eq__(self, other: object) -> bool:
        return str.__eq__(self, other) is True or other in self.stands_for

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(self.stands_for[0])

    def __reduce__(self) -> Any:
        return (SuiteBackend, (self.stands_for,))


def _device() -> str:
    device = os.environ.get(DEVICE_ENV, "")
    if device not in DEVICES:
        raise RuntimeError(f"{DEVICE_ENV} must be one of {DEVICES} (the runner sets it)")
    return device


def _claim_features(device: str, backend: SuiteBackend) -> None:
    """Make DistTestCases say what fastcomm supports on `device` (before the suite is loaded:
    its decorators read these sets at import). The feature sets get both names the suite
    looks up: `backend` (its BACKEND) and "fastcomm" (what dist.Backend(BACKEND) gives)."""
    from torch.testing._internal.common_distributed import DistTestCases

    for feature in FEATURES:
        DistTestCases.backend_feature.setdefault(feature, set()).update((backend, BACKEND_NAME))
    for collective in COLLECTIVES[device]:
        DistTestCases.skip_collective.setdefault(collective, set()).difference_update(
            (BACKEND_NAME, *STANDS_FOR[device])
        )


def _stock() -> bool:
    return os.environ.get(STOCK_ENV) == "1"


def _load_suite(device: str) -> Any:
    """distributed_test imported with its BACKEND bound to the SuiteBackend of `device` (with
    --stock: imported as it is, BACKEND naming the stock backend)."""
    if SUITE_MODULE in sys.modules:
        return sys.modules[SUITE_MODULE]
    import torch  # noqa: F401  (before torchext)
    import torch.distributed as dist

    if _stock():
        return importlib.import_module(SUITE_MODULE)

    import torchext  # noqa: F401  (registers the backend; also in every spawned rank)

    backend = SuiteBackend(STANDS_FOR[device])
    _claim_features(device, backend)
    spec = importlib.util.find_spec(SUITE_MODULE)
    if spec is None or spec.loader is None or spec.origin is None:
        raise RuntimeError(f"{SUITE_MODULE} not found in this torch")
    source = spec.loader.get_source(SUITE_MODULE)  # type: ignore[attr-defined]
    line = 'BACKEND = os.environ["BACKEND"]'
    if source is None or source.count(line) != 1:
        raise RuntimeError(f"{spec.origin} no longer reads BACKEND as `{line}`")
    source = source.replace(line, "BACKEND = __fastcomm_suite_backend__")
    module = importlib.util.module_from_spec(spec)
    module.__dict__["__fastcomm_suite_backend__"] = backend
    sys.modules[SUITE_MODULE] = module
    try:
        exec(compile(source, spec.origin, "exec", dont_inherit=True), module.__dict__)
    except BaseException:
        del sys.modules[SUITE_MODULE]
        raise
    for name in PROFILING_LISTS:
        allow = getattr(module, name, None)
        if isinstance(allow, list) and BACKEND_NAME not in allow:
            allow.append(dist.Backend(BACKEND_NAME))
    return module


_test_class: type | None = None


def suite_class() -> type:
    """The suite's tests as one TestCase class bound to fastcomm (built on first use)."""
    global _test_class
    if _test_class is None:
        _test_class = _make_class(_load_suite(_device()))
    return _test_class


def _make_class(suite: Any) -> type:
    class TestFastCommDist(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        def setUp(self) -> None:
            super().setUp()
            if os.environ.get(START_ENV, "spawn") == "fork":
                import torch.multiprocessing as mp

                self._start_processes(mp.get_context("fork").Process)
            else:
                self._spawn_processes()

        @classmethod
        def _run(cls, rank: int, test_name: str, file_name: str, pipe: Any, **kwargs: Any) -> None:
            # The suite reads INIT_METHOD at import, and its setUp points it at the test's own
            # directory in the environment: a forked rank has the module of the worker.
            suite.INIT_METHOD = os.environ.get("INIT_METHOD", suite.INIT_METHOD)
            super()._run(rank, test_name, file_name, pipe, **kwargs)

    TestFastCommDist.__qualname__ = TestFastCommDist.__name__ = TEST_CLASS
    return TestFastCommDist


def __getattr__(name: str) -> Any:
    # The spawned ranks unpickle their test class by name from this module.
    if name == TEST_CLASS:
        return suite_class()
    raise AttributeError(name)


def suite_test_names() -> list[str]:
    return sorted(unittest.TestLoader().getTestCaseNames(suite_class()))


def _wrapper_code(decorator: Any) -> Any:
    return decorator(lambda: None).__code__


def static_skip(name: str, gpus: int, world: int) -> str | None:
    """The reason the suite skips `name` with `gpus` accelerators and `world` ranks, where its
    decorators tell without running it, else None. Besides unittest's skip marks, these are the
    accelerator count a test needs (``_min_gpus_required``, which PyTorch's own conftest reads
    for the same purpose, and ``skip_if_no_gpu``: one per rank) and the world sizes it needs:
    the ranks would spawn, join a group and exit with the suite's skip code."""
    from torch.testing._internal import common_distributed as cd

    cls = suite_class()
    fn = getattr(cls, name)
    need = int(getattr(fn, "_min_gpus_required", 0))
    layer = fn
    while layer is not None:
        code = getattr(layer, "__code__", None)
        if code is _wrapper_code(cd.skip_if_no_gpu):
            need = max(need, world)
        elif code is _wrapper_code(cd.skip_if_small_worldsize) and world < 8:
            return cd.TEST_SKIPS["small_worldsize"].message
        elif code is _wrapper_code(cd.skip_if_odd_worldsize) and world % 2:
            return cd.TEST_SKIPS["odd_worldsize"].message
        layer = getattr(layer, "__wrapped__", None)
    if need > gpus:
        return cd.TEST_SKIPS["no_accelerator" if gpus == 0 else f"multi-device-{need}"].message
    if getattr(cls, "__unittest_skip__", False) or getattr(fn, "__unittest_skip__", False):
        return str(getattr(fn, "__unittest_skip_why__", "skipped"))
    return None


# ----------------------------------------------------------------------------------------------
# Results


PASSED, FAILED, SKIPPED, NOT_APPLICABLE = "passed", "failed", "skipped", "not applicable"

_EXC_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b")
_RANK_BLOCK = re.compile(r"^Process (\d+) exited with error code")


def first_error_line(text: str) -> str:
    """The line that says what went wrong: the exception the first failing rank raised, else the
    last exception line of the traceback, else its last line."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    for i, ln in enumerate(lines):
        m = _RANK_BLOCK.search(ln.removeprefix("RuntimeError: "))
        if m:
            block: list[str] = []
            for nxt in lines[i + 1 :]:
                if _RANK_BLOCK.search(nxt):
                    break
                block.append(nxt)
            found = [b for b in block if _EXC_LINE.match(b)]
            if found:
                return f"rank {m.group(1)}: {found[-1]}"
    found = [ln for ln in lines if _EXC_LINE.match(ln)]
    if found:
        return found[-1]
    return lines[-1] if lines else ""


@dataclasses.dataclass
class Outcome:
    test: str
    status: str
    seconds: float = 0.0
    reason: str = ""  # skip / not-applicable reason, or the first error line
    error: str = ""  # full error text of a failure

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if not self.error:
            d.pop("error")
        return d


class _Result(unittest.TestResult):
    def __init__(self) -> None:
        super().__init__()
        self.outcome: tuple[str, str, str] | None = None

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self.outcome = (SKIPPED, reason, "")

    def _fail(self, test: unittest.TestCase, err: Any) -> None:
        text = self._exc_info_to_string(err, test)
        if self.outcome is None or self.outcome[0] != FAILED:
            self.outcome = (FAILED, first_error_line(text), text)

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self._fail(test, err)

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._fail(test, err)

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        super().addUnexpectedSuccess(test)
        self.outcome = (FAILED, "unexpected success", "")


def run_one(name: str) -> Outcome:
    """Runs one test of the suite in this process (which spawns its ranks)."""
    start = time.monotonic()
    result = _Result()
    unittest.TestSuite([suite_class()(name)]).run(result)
    status, reason, error = result.outcome or (PASSED, "", "")
    return Outcome(name, status, round(time.monotonic() - start, 2), reason, error)


def worker_main(result_fd: int) -> int:
    """Runs the tests named on stdin, one a line, writing one JSON outcome a line to
    `result_fd` as each ends."""
    suite_class()
    with os.fdopen(result_fd, "w", buffering=1) as out:
        out.write(json.dumps({"ready": True}) + "\n")
        for line in sys.stdin:
            name = line.strip()
            if not name:
                continue
            print(f"===== {name}", flush=True)
            out.write(json.dumps(run_one(name).to_json()) + "\n")
    return 0


# ----------------------------------------------------------------------------------------------
# The run: selection, workers, summary


def _not_applicable(device: str) -> dict[str, str]:
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(
        "torch_suite_not_applicable", os.path.join(here, "torch_suite_not_applicable.py")
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.for_device(device)


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(
        fnmatch.fnmatchcase(name, p) if any(c in p for c in "*?[") else p in name for p in patterns
    )


def select(names: Sequence[str], keywords: Sequence[str], shard: tuple[int, int]) -> list[str]:
    """The tests of `names` matching any of `keywords` (all if none), then the `shard`
    (i, n): every n-th of them from the i-th on."""
    if keywords:
        names = [n for n in names if _matches(n, keywords)]
    index, count = shard
    return [n for i, n in enumerate(names) if i % count == index - 1]


class _Worker:
    """One worker process and the test it runs."""

    def __init__(self, ident: int, run_dir: str, env: dict[str, str], argv: list[str]) -> None:
        self.ident = ident
        self.dir = os.path.join(run_dir, f"job{ident}")
        tmp = os.path.join(self.dir, "tmp")
        os.makedirs(tmp, exist_ok=True)
        read_fd, write_fd = os.pipe()
        env = dict(env, TMPDIR=tmp, TEMP_DIR=tmp)
        self.log_path = os.path.join(self.dir, "worker.log")
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            argv + ["--worker-fd", str(write_fd)],
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            pass_fds=(write_fd,),
            start_new_session=True,  # its ranks are killed with it
        )
        os.close(write_fd)
        self.results = os.fdopen(read_fd, "r")
        self.test: str | None = None
        self.started = 0.0

    def give(self, name: str) -> None:
        self.test, self.started = name, time.monotonic()
        assert self.proc.stdin is not None
        self.proc.stdin.write((name + "\n").encode())
        self.proc.stdin.flush()

    def stop(self, kill: bool = False) -> None:
        if kill:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
        elif self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
        self.results.close()
        self.log.close()

    def log_tail(self, chars: int = 4000) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            return f.read().decode(errors="replace")


class _Pool:
    """Workers that take the next test as they become free."""

    def __init__(
        self, jobs: int, run_dir: str, env: dict[str, str], timeout: float, report: Any
    ) -> None:
        self.jobs = jobs
        self.run_dir = run_dir
        self.env = env
        self.timeout = timeout  # seconds a worker may spend on one test
        self.report = report  # called with each Outcome
        self.argv = [sys.executable, os.path.abspath(__file__), "--worker"]
        self.workers: list[_Worker] = []
        self.sel = selectors.DefaultSelector()
        self.pending: list[str] = []
        self.launched = 0

    def run(self, names: list[str]) -> None:
        self.pending = list(reversed(names))
        try:
            for _ in range(min(self.jobs, len(names))):
                self._start()
            while self.workers:
                self._step()
        finally:
            for w in list(self.workers):
                self._retire(w, kill=True)

    def _start(self) -> None:
        w = _Worker(self.launched, self.run_dir, self.env, self.argv)
        self.launched += 1
        self.workers.append(w)
        self.sel.register(w.results, selectors.EVENT_READ, w)

    def _retire(self, w: _Worker, kill: bool) -> None:
        self.sel.unregister(w.results)
        self.workers.remove(w)
        w.stop(kill)

    def _record(self, o: Outcome) -> None:
        self.report(o)

    def _lost(self, w: _Worker, why: str) -> None:
        """`w` ended or was stopped without a result: its test failed, a new worker goes on."""
        if w.test is not None:
            self._record(
                Outcome(w.test, FAILED, round(time.monotonic() - w.started, 2), why, w.log_tail())
            )
        self._retire(w, kill=True)
        if self.pending:
            self._start()

    def _step(self) -> None:
        for key, _ in self.sel.select(timeout=5.0):
            w: _Worker = key.data
            line = w.results.readline()
            if not line:
                self._lost(w, f"worker exited with {w.proc.poll()}")
                continue
            msg = json.loads(line)
            if not msg.get("ready"):
                self._record(Outcome(**msg))
            w.test = None
            if self.pending:
                w.give(self.pending.pop())
            else:
                self._retire(w, kill=False)
        now = time.monotonic()
        for w in list(self.workers):
            if w.test is not None and now - w.started > self.timeout:
                self._lost(w, f"no result after {self.timeout:.0f} s; worker killed")


def _parse_shard(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)/(\d+)", text)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise argparse.ArgumentTypeError("--shard takes i/n with 1 <= i <= n")
    return int(m.group(1)), int(m.group(2))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Run PyTorch's DistributedTest suite against the fastcomm backend.",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="cpu: CPU tensors (GPUs hidden); cuda: CUDA tensors, one GPU per rank",
    )
    p.add_argument(
        "--world", type=int, default=None, help="ranks per test (default: 3 on cpu, 2 on cuda)"
    )
    p.add_argument("--jobs", type=int, default=1, help="tests run at once (default 1)")
    p.add_argument(
        "-k",
        dest="keywords",
        action="append",
        default=[],
        help="run tests whose name contains this (or matches this glob); repeatable",
    )
    p.add_argument(
        "--shard",
        type=_parse_shard,
        default=(1, 1),
        metavar="I/N",
        help="run the I-th of N interleaved slices of the selected tests",
    )
    p.add_argument(
        "--start",
        choices=("spawn", "fork"),
        default="spawn",
        help="how ranks start: spawn (fresh interpreters, as PyTorch runs the suite) "
        "or fork (from the worker, which has imported torch already: several times "
        "faster; --device cpu only)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds one test may take (the suite's own limit; default 300)",
    )
    p.add_argument(
        "--stock",
        action="store_true",
        help="run on the stock backend of the device instead (gloo on cpu, nccl on cuda), "
        "to tell a failure of the test itself from one of fastcomm",
    )
    p.add_argument("--json", dest="json_path", help="write the summary as JSON here")
    p.add_argument(
        "--keep", metavar="DIR", help="keep the workers' logs and temporary files in DIR"
    )
    p.add_argument(
        "--list",
        action="store_true",
        help="print the selected tests and their planned status, run nothing",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-fd", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _suite_env(device: str, world: int, timeout: float, start: str, stock: bool) -> dict[str, str]:
    env = {
        "BACKEND": STANDS_FOR[device][0] if stock else BACKEND_NAME,
        STOCK_ENV: "1" if stock else "0",
        "WORLD_SIZE": str(world),
        DEVICE_ENV: device,
        START_ENV: start,
        # The suite's own limit per test; the runner's is a little longer.
        "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(int(timeout)),
        # file:// rendezvous in the test's temporary directory (as PyTorch's CI runs the suite);
        # the suite sets the real path per test.
        "INIT_METHOD": "file://"
        + os.path.join(tempfile.gettempdir(), "init_dir", "shared_init_file"),
    }
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU tensors only, whatever the machine has
    return env


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker_fd)
    world = args.world or DEFAULT_WORLD[args.device]
    if args.start == "fork" and args.device == "cuda":
        print("--start fork is for --device cpu (CUDA does not survive a fork)", file=sys.stderr)
        return 2
    suite_env = _suite_env(args.device, world, args.timeout, args.start, args.stock)
    os.environ.update(suite_env)
    os.environ.setdefault("TEMP_DIR", tempfile.gettempdir())

    # A terminated run still stops its workers and their ranks (see _Pool.run).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    started = time.monotonic()
    import torch

    gpus = torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    if args.device == "cuda" and gpus < world:
        if not args.list:
            print(f"--device cuda needs {world} GPUs, found {gpus}", file=sys.stderr)
            return 2
        print(f"(listing as on a machine with {world} GPUs)")
        gpus = world
    selected = select(suite_test_names(), args.keywords, args.shard)
    not_applicable = {} if args.stock else _not_applicable(args.device)
    outcomes: list[Outcome] = []
    to_run: list[str] = []
    for name in selected:
        why_na = next((r for p, r in not_applicable.items() if fnmatch.fnmatchcase(name, p)), None)
        if why_na is not None:
            outcomes.append(Outcome(name, NOT_APPLICABLE, reason=why_na))
        elif (why := static_skip(name, gpus, world)) is not None:
            outcomes.append(Outcome(name, SKIPPED, reason=why))
        else:
            to_run.append(name)
    backend = os.environ["BACKEND"]
    print(
        f"{backend} on PyTorch's DistributedTest: torch {torch.__version__}, device "
        f"{args.device}, world {world}, {len(selected)} tests selected: {len(to_run)} to run, "
        f"{len(selected) - len(to_run)} skipped by the suite or not applicable",
        flush=True,
    )
    if args.list:
        for o in outcomes:
            print(f"  {o.status:14} {o.test}: {o.reason}")
        for name in to_run:
            print(f"  {'run':14} {name}")
        return 0

    env = dict(os.environ)  # with suite_env, set above
    meta = {
        "backend": backend,
        "device": args.device,
        "world_size": world,
        "torch": torch.__version__,
        "start": args.start,
        "jobs": args.jobs,
    }
    done = [0]

    def report(o: Outcome) -> None:
        outcomes.append(o)
        done[0] += 1
        line = f"[{done[0]:>3}/{len(to_run)}] {o.status.upper():7} {o.test} ({o.seconds:.1f} s)"
        if o.status != PASSED:
            line += f": {o.reason}"
        print(line, flush=True)
        if args.json_path:
            write_json(args.json_path, outcomes, meta, time.monotonic() - started, False)

    with tempfile.TemporaryDirectory(prefix="fastcomm-suite-") as tmp:
        run_dir = args.keep or tmp
        os.makedirs(run_dir, exist_ok=True)
        _Pool(max(1, args.jobs), run_dir, env, args.timeout + 60, report).run(to_run)
    wall = time.monotonic() - started
    if args.json_path:
        write_json(args.json_path, outcomes, meta, wall, True)
    return summarize(outcomes, meta, wall)


def _counts(outcomes: Sequence[Outcome]) -> dict[str, int]:
    return {
        s: sum(o.status == s for o in outcomes) for s in (PASSED, FAILED, SKIPPED, NOT_APPLICABLE)
    }


def write_json(
    path: str, outcomes: Sequence[Outcome], meta: dict[str, Any], wall: float, complete: bool
) -> None:
    """The summary as JSON; rewritten as each test ends (``complete`` false until the run
    ends), so a run stopped from outside leaves what it did."""
    order = {n: i for i, n in enumerate(suite_test_names())}
    summary = dict(
        meta,
        complete=complete,
        wall_s=round(wall, 1),
        counts=_counts(outcomes),
        tests=[o.to_json() for o in sorted(outcomes, key=lambda o: order.get(o.test, 0))],
    )
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(path + ".tmp", path)


def summarize(outcomes: Sequence[Outcome], meta: dict[str, Any], wall: float) -> int:
    """Prints the failures and the counts; the exit status of the run."""
    counts = _counts(outcomes)
    failed = [o for o in outcomes if o.status == FAILED]
    print()
    if failed:
        print("failures:")
        for o in failed:
            print(f"  {o.test}: {o.reason}")
    print(
        f"{meta['backend']} on DistributedTest ({meta['device']}, world {meta['world_size']}, torch "
        f"{meta['torch']}): {counts[PASSED]} passed, {counts[FAILED]} failed, "
        f"{counts[SKIPPED]} skipped, {counts[NOT_APPLICABLE]} not applicable in "
        f"{wall / 60:.1f} min"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
