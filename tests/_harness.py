"""A small multi-process harness for torch.distributed tests.

``run_ranks(world_size, fn, *args)`` starts ``world_size`` fresh Python processes (not
forks: every rank imports torch itself, as under torchrun), each with the usual
torchrun environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE) plus any extra per-rank environment, optionally initialises the
default process group, calls ``fn(rank, world_size, *args)`` and ships the return value
(or the exception with its traceback) back to the parent. If any rank fails, the calling
test fails with every rank's traceback and the tail of its output. A hard timeout kills
every child (after asking each for a Python stack dump), so a hang fails the test instead
of blocking CI.

``fn`` must be importable by the child: a module-level function of a module in tests/.

The backend under test is chosen with the environment variable FASTCOMM_TEST_BACKEND
(default "fastcomm"; e.g. FASTCOMM_TEST_BACKEND=gloo to validate the tests themselves).
``torchext`` is imported in the children only when the backend is "fastcomm".

Importing torch costs seconds per process, so tests should run many checks inside one
spawned group rather than spawning a group per case.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pickle
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Union

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

#: Name of the backend under test (FASTCOMM_TEST_BACKEND, default "fastcomm").
BACKEND: str = os.environ.get("FASTCOMM_TEST_BACKEND", "fastcomm").strip().lower() or "fastcomm"

EnvSpec = Union[None, Mapping[str, str], Callable[[int], Mapping[str, str]]]

_OUTPUT_TAIL_CHARS = 6000


def load_benchmark_module(relpath: str) -> Any:
    """benchmarks/<relpath>.py (e.g. "netbed", "tools/ncu_summary") as a module named by its
    file (the benchmarks are scripts, not a package; registered in sys.modules first, where
    dataclasses look their module up)."""
    import importlib.util

    name = os.path.basename(relpath)
    path = os.path.join(os.path.dirname(TESTS_DIR), "benchmarks", f"{relpath}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def backend_under_test() -> str:
    """The backend the suite runs against (FASTCOMM_TEST_BACKEND, default "fastcomm")."""
    return BACKEND


def is_gloo() -> bool:
    return BACKEND == "gloo"


def gloo_skip(reason: str) -> pytest.MarkDecorator:
    """Skip marker that applies ONLY when the backend under test is gloo."""
    return pytest.mark.skipif(is_gloo(), reason=f"gloo: {reason}")


def load_script(name: str) -> Any:
    """scripts/<name>.py as a module (the scripts are no package), for tests of their functions."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
    spec = importlib.util.spec_from_file_location(name, os.path.join(path, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def capture_stderr(path: str) -> None:
    """Sends fd 2 (where fastcomm logs) to `path` for the rest of this process."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now, chosen below the kernel's ephemeral
    range: a port from bind(0) is ephemeral, and the many connections the tests open draw
    their local ports from that range, so one of them could take it before rank 0 listens
    (EADDRINUSE)."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, max(low, 10001))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class RankFailure:
    """What came back from a rank that failed (returned in place of its result)."""

    rank: int
    exitcode: int | None
    error: str | None  # "Type: message" of the exception, if the rank reported one
    traceback: str | None
    output_tail: str

    def describe(self) -> str:
        head = f"--- rank {self.rank}: exit code {self.exitcode}"
        if self.exitcode is not None and self.exitcode < 0:
            try:
                head += f" (killed by {signal.Signals(-self.exitcode).name})"
            except ValueError:
                pass
        body = self.traceback or (self.error or "(no Python exception reported)")
        out = self.output_tail.strip()
        return f"{head}\n{body.rstrip()}\n--- rank {self.rank} output (tail):\n{out or '(none)'}\n"


class RanksFailed(AssertionError):
    """Raised (as a test failure) when ranks failed; carries every rank's outcome."""

    def __init__(self, message: str, failures: list[RankFailure], results: list[Any]) -> None:
        super().__init__(message)
        self.failures = failures
        self.results = results


# ----------------------------------------------------------------------------- parent side


def _tail(path: str, n: int = _OUTPUT_TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            data = f.read().decode("utf-8", "replace")
        return ("[...]\n" if size > n else "") + data
    except OSError:
        return ""


def _rank_env(env: EnvSpec, rank: int) -> dict[str, str]:
    if env is None:
        return {}
    extra = env(rank) if callable(env) else env
    return {str(k): str(v) for k, v in dict(extra).items()}


def _normalize_expect_fail(expect_fail: Any) -> dict[int, int | None]:
    """rank -> expected exit code (None: any failure)."""
    if expect_fail is None:
        return {}
    if isinstance(expect_fail, int):
        return {expect_fail: None}
    if isinstance(expect_fail, Mapping):
        return {int(k): (None if v is None else int(v)) for k, v in expect_fail.items()}
    return {int(r): None for r in expect_fail}


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str = BACKEND,
    env: EnvSpec = None,
    timeout_s: float = 240.0,
    expect_fail: None | int | Iterable[int] | Mapping[int, int | None] = None,
    init: bool = True,
    pg_timeout_s: float = 60.0,
    import_torchext: bool | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes.

    Args:
        world_size: number of ranks (processes).
        fn: module-level function of an importable module (tests/*.py).
        args: picklable extra arguments.
        backend: backend name; the children see it as FASTCOMM_TEST_BACKEND, and with
            ``init=True`` the default group is created with it.
        env: extra environment for every rank (dict) or per rank (callable rank -> dict).
        timeout_s: hard wall-clock limit for the whole group; then all ranks are killed
            and the test fails with their stack dumps.
        expect_fail: ranks that are expected to fail (exit non-zero or raise), as an int,
            an iterable of ranks, or a dict rank -> expected exit code (None: any).
            Their entry in the returned list is a :class:`RankFailure`. A rank listed here
            that succeeds fails the test.
        init: create the default process group (env://, ``pg_timeout_s``) before ``fn``
            and destroy it afterwards if ``fn`` left it initialised.
        pg_timeout_s: timeout of the default process group when ``init`` is True.
        import_torchext: import torchext in the children before ``fn``; default: only
            when ``backend == "fastcomm"``.

    Returns:
        The per-rank return values of ``fn`` (RankFailure for expected failures).
    """
    if import_torchext is None:
        import_torchext = backend == "fastcomm"
    module = fn.__module__
    qualname = fn.__qualname__
    if "<locals>" in qualname or module == "__main__":
        raise ValueError(f"fn must be a module-level function of an importable module: {fn}")
    mod_file = getattr(sys.modules.get(module), "__file__", None)
    mod_dir = os.path.dirname(os.path.abspath(mod_file)) if mod_file else TESTS_DIR
    expected = _normalize_expect_fail(expect_fail)

    workdir = tempfile.mkdtemp(prefix="fastcomm_test_")
    port = free_port()
    spec = {
        "module": module,
        "qualname": qualname,
        "sys_path": [TESTS_DIR, mod_dir],
        "args": args,
        "backend": backend,
        "init": init,
        "pg_timeout_s": pg_timeout_s,
        "import_torchext": import_torchext,
    }
    spec_path = os.path.join(workdir, "spec.pkl")
    with open(spec_path, "wb") as f:
        pickle.dump(spec, f)

    procs: list[subprocess.Popen] = []
    logs: list[str] = []
    bootstrap = (
        "import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
        f"sys.path.insert(0, {TESTS_DIR!r}); import _harness; _harness._child_main()"
    )
    try:
        for rank in range(world_size):
            child_env = dict(os.environ)
            child_env.update(
                {
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world_size),
                    "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(world_size),
                    "GROUP_RANK": "0",
                    "FASTCOMM_TEST_BACKEND": backend,
                    "FASTCOMM_TEST_SPEC": spec_path,
                    "FASTCOMM_TEST_RESULT": os.path.join(workdir, f"rank{rank}.pkl"),
                    # 4 ranks share 2 cores: keep intra-op thread pools small.
                    "OMP_NUM_THREADS": child_env.get("OMP_NUM_THREADS", "1"),
                    "PYTHONFAULTHANDLER": "1",
                    "PYTHONUNBUFFERED": "1",
                }
            )
            child_env.update(_rank_env(env, rank))
            log = os.path.join(workdir, f"rank{rank}.log")
            logs.append(log)
            with open(log, "wb") as out:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", bootstrap],
                        env=child_env,
                        cwd=workdir,  # never the repo root: it would shadow installed torchext
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )

        # FASTCOMM_TEST_TIMEOUT_CAP (seconds) shortens every group's limit, e.g. to get
        # the stacks of a hang on a lent GPU machine within its time.
        cap = os.environ.get("FASTCOMM_TEST_TIMEOUT_CAP")
        if cap:
            timeout_s = min(timeout_s, float(cap))
        deadline = time.monotonic() + timeout_s
        timed_out = False
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
        if timed_out:
            hung = [r for r, p in enumerate(procs) if p.poll() is None]
            for r in hung:  # ask for a Python stack dump first (faulthandler on SIGUSR1)
                try:
                    os.kill(procs[r].pid, signal.SIGUSR1)
                except OSError:
                    pass
            time.sleep(1.0)
            if os.environ.get("FASTCOMM_CRASH_BACKTRACE") == "1":
                # fastcomm then prints every thread's native stack on SIGUSR2.
                for r in hung:
                    try:
                        os.kill(procs[r].pid, signal.SIGUSR2)
                    except OSError:
                        pass
                time.sleep(5.0)
            _kill_all(procs)
            keep = os.environ.get("FASTCOMM_TEST_HANG_DIR")
            if keep:  # the whole output of hung ranks (the tail below is short)
                os.makedirs(keep, exist_ok=True)
                for r in hung:
                    shutil.copy(logs[r], os.path.join(keep, f"{fn.__name__}-rank{r}.log"))
            failures = [
                RankFailure(
                    r, p.returncode, None, None, _tail(logs[r])
                )  # a stack dump is in the output tail of hung ranks
                for r, p in enumerate(procs)
            ]
            details = "".join(f.describe() for f in failures)
            raise RanksFailed(
                f"hard timeout after {timeout_s:.0f}s: rank(s) {hung} still running "
                f"(killed); {fn.__name__}{args!r:.200} on {world_size} ranks, backend "
                f"{backend}\n{details}",
                failures,
                [],
            )

        results: list[Any] = []
        unexpected: list[RankFailure] = []
        for rank, p in enumerate(procs):
            payload = _read_result(os.path.join(workdir, f"rank{rank}.pkl"))
            ok = payload is not None and payload.get("ok") and p.returncode == 0
            if ok:
                if rank in expected:
                    unexpected.append(
                        RankFailure(
                            rank,
                            p.returncode,
                            "rank was expected to fail but succeeded",
                            None,
                            _tail(logs[rank]),
                        )
                    )
                results.append(payload["result"])
                continue
            error = tb = None
            if payload is not None and not payload.get("ok"):
                error, tb = payload.get("error"), payload.get("traceback")
            elif payload is not None and payload.get("ok"):
                error = f"fn returned, but the process then exited with code {p.returncode}"
            failure = RankFailure(rank, p.returncode, error, tb, _tail(logs[rank]))
            results.append(failure)
            if rank in expected and (expected[rank] is None or expected[rank] == p.returncode):
                continue
            unexpected.append(failure)
        if unexpected:
            details = "".join(f.describe() for f in unexpected)
            summary = ", ".join(
                f"rank {f.rank}: {(f.error or f'exit code {f.exitcode}').splitlines()[0][:300]}"
                for f in unexpected
            )
            raise RanksFailed(
                f"{len(unexpected)} of {world_size} rank(s) failed in {fn.__name__} "
                f"(backend {backend}): {summary}\n{details}",
                unexpected,
                results,
            )
        return results
    finally:
        _kill_all(procs)
        _rmtree(workdir)


def _read_result(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the child's own session (start_new_session)
            except OSError:
                try:
                    p.kill()
                except OSError:
                    pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------ child side


def _write_result(payload: dict[str, Any]) -> None:
    path = os.environ["FASTCOMM_TEST_RESULT"]
    tmp = path + ".tmp"
    try:
        data = pickle.dumps(payload)
    except Exception as e:  # unpicklable result: report that instead
        data = pickle.dumps(
            {"ok": False, "error": f"result not picklable: {e!r}", "traceback": None}
        )
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _child_main() -> None:
    import faulthandler

    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)

    with open(os.environ["FASTCOMM_TEST_SPEC"], "rb") as f:
        spec = pickle.load(f)
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    for p in reversed(spec["sys_path"]):
        if p not in sys.path:
            sys.path.insert(0, p)
    try:
        from datetime import timedelta

        import torch  # noqa: F401
        import torch.distributed as dist

        if spec["import_torchext"]:
            import torchext  # noqa: F401  (registers the backend)
        fn = importlib.import_module(spec["module"])
        for part in spec["qualname"].split("."):
            fn = getattr(fn, part)
        if spec["init"]:
            dist.init_process_group(
                backend=spec["backend"],
                init_method="env://",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=spec["pg_timeout_s"]),
            )
        result = fn(rank, world_size, *spec["args"])
        if spec["init"] and dist.is_initialized():
            dist.destroy_process_group()
        payload = {"ok": True, "result": result}
    except BaseException as e:
        payload = {
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc(),
        }
        print(payload["traceback"], file=sys.stderr, flush=True)
    _write_result(payload)
    sys.stdout.flush()
    sys.stderr.flush()
    # A normal interpreter exit (not os._exit): a backend that hangs or crashes at
    # shutdown must show up (as a hard timeout or a non-zero exit code).
    sys.exit(0 if payload["ok"] else 1)


# ---------------------------------------------------------------------------- data helpers
#
# Inputs are fresh random data seeded from (case key, rank), so every rank can regenerate
# every other rank's input locally and compute the reference itself, independently of the
# collective under test. References are computed in float64 / int64 and cast.

REDUCE_OP_NAMES = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
DTYPE_NAMES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int8",
    "uint8",
    "int32",
    "int64",
    "bool",
)


def dtype_of(name: str) -> Any:
    import torch

    return getattr(torch, name)


def reduce_op(name: str) -> Any:
    import torch.distributed as dist

    return getattr(dist.ReduceOp, name)


def valid_ops(dtype_name: str) -> list[str]:
    """Reduce ops that are meaningful for a dtype (bitwise only for integers and bool;
    AVG not for bool)."""
    if dtype_name in ("float32", "float64", "float16", "bfloat16"):
        return ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]
    if dtype_name == "bool":
        return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
    return list(REDUCE_OP_NAMES)


def seed_of(*parts: Any) -> int:
    import zlib

    return zlib.crc32("|".join(str(p) for p in parts).encode()) & 0x7FFFFFFF


_SUM_LIMITS = {"int8": 30, "uint8": 60, "int32": 2**28, "int64": 2**60}


def gen(key: str, rank: int, shape: Any, dtype: Any, mode: str = "any") -> Any:
    """Deterministic random CPU tensor for (key, rank); never all zeros.

    ``mode`` is the reduce op the data is meant for (value ranges that cannot overflow
    and, for PRODUCT, stay exact), or "any".
    """
    import torch

    shape = tuple(shape)
    g = torch.Generator().manual_seed(seed_of(key, rank))
    if dtype == torch.bool:
        p = {"PRODUCT": 0.85, "MIN": 0.85, "BAND": 0.85, "SUM": 0.15, "MAX": 0.15, "BOR": 0.15}
        return torch.rand(shape, generator=g) < p.get(mode, 0.5)
    if dtype.is_floating_point:
        if mode == "PRODUCT":  # powers of two: products are exact in any order
            vals = torch.tensor([-1.0, 0.5, 1.0, 2.0], dtype=torch.float64)
            return vals[torch.randint(0, 4, shape, generator=g)].to(dtype)
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    name = str(dtype).replace("torch.", "")
    unsigned = dtype == torch.uint8
    if mode == "PRODUCT":
        vals = torch.tensor([1, 2] if unsigned else [-1, 1, 2], dtype=torch.int64)
        return vals[torch.randint(0, len(vals), shape, generator=g)].to(dtype)
    if mode in ("SUM", "AVG"):
        lim = _SUM_LIMITS[name]
        lo, hi = (1 if unsigned else -lim), lim
    else:
        info = torch.iinfo(dtype)
        lo, hi = info.min, info.max
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def reduce_reference(inputs: list[Any], op: str) -> tuple[Any, Any | None]:
    """Reference of reducing ``inputs`` (CPU tensors, one per rank) with ``op``.

    Returns (expected, bound): for float SUM/AVG, ``expected`` is float64 and ``bound`` a
    per-element error bound valid for any summation order in the input dtype; otherwise
    ``expected`` has the input dtype and must match exactly (bound None).
    """
    import torch

    dtype = inputs[0].dtype
    n = len(inputs)
    if dtype.is_floating_point:
        x = torch.stack([t.to(torch.float64) for t in inputs])
        if op in ("SUM", "AVG"):
            s = x.sum(0)
            eps = torch.finfo(dtype).eps
            bound = (n + 1) * eps * x.abs().sum(0) + torch.finfo(dtype).smallest_normal
            if op == "AVG":
                return s / n, bound / n
            return s, bound
        if op == "PRODUCT":
            return x.prod(0).to(dtype), None
        if op == "MIN":
            return x.amin(0).to(dtype), None
        if op == "MAX":
            return x.amax(0).to(dtype), None
        raise ValueError(f"{op} is not valid for {dtype}")
    x = torch.stack([t.to(torch.int64) for t in inputs])
    if op == "SUM":
        r = x.sum(0)
    elif op == "AVG":
        if dtype == torch.bool:
            raise ValueError("AVG is not valid for bool")
        r = torch.div(x.sum(0), n, rounding_mode="trunc")
    elif op == "PRODUCT":
        r = x.prod(0)
    elif op == "MIN":
        r = x.amin(0)
    elif op == "MAX":
        r = x.amax(0)
    elif op in ("BAND", "BOR", "BXOR"):
        f = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        r = x[0]
        for i in range(1, n):
            r = f(r, x[i])
    else:
        raise ValueError(op)
    if dtype == torch.bool:
        # SUM/MAX/BOR: logical or; PRODUCT/MIN/BAND: logical and; BXOR: parity.
        return (r != 0) if op != "BXOR" else (r % 2 != 0), None
    return r.to(dtype), None


def _first_mismatch(mask: Any) -> str:
    import torch

    idx = torch.nonzero(mask)
    if idx.numel() == 0:
        return ""
    first = tuple(int(i) for i in idx[0])
    return f"{int(mask.sum())} of {mask.numel()} element(s) differ, first at index {first}"


class Checker:
    """Collects check failures instead of raising at once, so that every rank still runs
    every collective of a case (a rank that stopped early would desynchronise the group)."""

    def __init__(self, label: str = "") -> None:
        self.label = label
        self.errors: list[str] = []

    def fail(self, msg: str) -> None:
        self.errors.append(msg)

    def true(self, cond: bool, msg: str) -> None:
        if not cond:
            self.fail(msg)

    def equal(self, actual: Any, expected: Any, what: str) -> None:
        """Exact equality (dtype, shape, values)."""
        import torch

        a = actual.detach().cpu()
        e = expected.detach().cpu()
        if a.dtype != e.dtype or a.shape != e.shape:
            self.fail(f"{what}: got {a.dtype}{tuple(a.shape)}, expected {e.dtype}{tuple(e.shape)}")
            return
        if a.numel() == 0:
            return
        if a.dtype.is_floating_point:
            same = (a == e) | (torch.isnan(a) & torch.isnan(e))
        else:
            same = a == e
        if not bool(same.all()):
            bad = ~same
            i = tuple(int(v) for v in torch.nonzero(bad)[0])
            self.fail(
                f"{what}: {_first_mismatch(bad)}: got {a[i].item()!r}, expected {e[i].item()!r}"
            )

    def reduced(self, actual: Any, inputs: list[Any], op: str, what: str) -> None:
        """``actual`` must equal the reduction of ``inputs`` (exact, or within the
        order-independent rounding bound for float SUM/AVG)."""
        import torch

        expected, bound = reduce_reference(inputs, op)
        if bound is None:
            self.equal(actual, expected, what)
            return
        a = actual.detach().cpu()
        if a.dtype != inputs[0].dtype or a.shape != expected.shape:
            self.fail(
                f"{what}: got {a.dtype}{tuple(a.shape)}, expected "
                f"{inputs[0].dtype}{tuple(expected.shape)}"
            )
            return
        if a.numel() == 0:
            return
        err = (a.to(torch.float64) - expected).abs()
        bad = ~(err <= bound)  # also catches NaN
        if bool(bad.any()):
            i = tuple(int(v) for v in torch.nonzero(bad)[0])
            self.fail(
                f"{what}: {_first_mismatch(bad)}: got {a[i].item()!r}, expected "
                f"{expected[i].item()!r} +- {bound[i].item():.3g} (max error "
                f"{err.max().item():.3g})"
            )

    def close(self, actual: Any, expected: Any, what: str, rtol: float, atol: float) -> None:
        import torch

        try:
            torch.testing.assert_close(
                actual.detach().cpu(), expected.detach().cpu(), rtol=rtol, atol=atol
            )
        except AssertionError as e:
            self.fail(f"{what}: {e}")

    def peer_failure(
        self, error: BaseException, started: float, limit_s: float, op: str, victim: int
    ) -> dict[str, Any]:
        """The error a survivor's `op` raised after rank `victim` died: raised within `limit_s`
        of `started` (time.monotonic()), a timeout naming `op` and the victim. Returns its
        elapsed seconds and message, for the test's report."""
        elapsed = time.monotonic() - started
        msg = str(error)
        self.true(elapsed <= limit_s, f"raised after {elapsed:.1f}s")
        self.peer_timeout(msg, op, victim)
        return {"elapsed": elapsed, "message": msg}

    def destroy_within(self, limit_s: float) -> float:
        """dist.destroy_process_group() returns (normally) within `limit_s`: its seconds."""
        import torch.distributed as dist

        started = time.monotonic()
        dist.destroy_process_group()
        seconds = time.monotonic() - started
        self.true(seconds <= limit_s, f"destroy_process_group() took {seconds:.1f}s")
        return seconds

    def peer_timeout(self, msg: str, op: str, victim: int) -> None:
        """`msg` is a timeout error of `op` that names the dead rank `victim` in a rank list:
        "[1]", or "[1, 3]" when a survivor that already failed and left is named beside it."""
        import re

        self.true(op in msg, f"error does not name {op}: {msg!r}")
        named = [{int(r) for r in m.split(",")} for m in re.findall(r"\[(\d+(?:, \d+)*)\]", msg)]
        self.true(any(victim in s for s in named), f"error does not name rank [{victim}]: {msg!r}")
        self.true("timeout" in msg.lower(), f"error does not mention the timeout: {msg!r}")

    def raise_if_failed(self) -> None:
        if self.errors:
            head = f"{self.label}: " if self.label else ""
            raise AssertionError(
                head + f"{len(self.errors)} check(s) failed:\n  " + "\n  ".join(self.errors)
            )
