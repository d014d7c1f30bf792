r"""What fastcomm's flight recorder costs per collective.

Run under torchrun (2 ranks are enough):

    torchrun --nproc_per_node=2 benchmarks/bench_trace.py --device cpu
    torchrun --nproc_per_node=2 benchmarks/bench_trace.py --device cuda

The flight recorder is set per group, when the group is created (FASTCOMM_TRACE_BUFFER_SIZE),
so one run creates a group per configuration over the same ranks:

- ``off``: FASTCOMM_TRACE_BUFFER_SIZE=0;
- ``on``: FASTCOMM_TRACE_BUFFER_SIZE=2000 (the default);
- ``stack``: the same with FASTCOMM_TRACE_PYTHON_STACK=1, called from --stack-depth nested frames;
- ``torch-hook`` (--torch-hook, torch versions that have it): the recorder off and torch's own
  c10d FlightRecorderHook attached instead, as torch attaches it to out-of-tree backends by
  default (``import torchext`` declares fastcomm as recording itself, so torch skips it).

Each configuration is timed in --repeats blocks of --iters small all_reduces (--numel float32
elements), the configurations interleaved (off, on, stack, ..., off, on, ...); a block's time per
call is the slowest rank's, and the median and the minimum over blocks are reported with their
difference from ``off``. On CUDA the host time to issue the block (the launch path, which the recorder adds to)
is reported as well as the time until the GPU is done.

With ``torchext._testing`` built (FASTCOMM_BUILD_TESTING=1) it also times the recorder's calls
alone in this process (record, started, completed of one op): on one thread, which scheduling
noise hardly blurs, and with a second thread that starts and completes each op as a lane does
(both spin, so that number needs an idle machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable
from unittest import mock

import torch
import torch.distributed as dist

import torchext


def nested(depth: int, fn: Callable[[], None]) -> None:
    """Calls ``fn`` from ``depth`` nested Python frames (a training step's stack is deep)."""
    if depth <= 0:
        fn()
    else:
        nested(depth - 1, fn)


def make_group(env: dict[str, str]) -> dist.ProcessGroup:
    with mock.patch.dict(os.environ, env):  # read when the group is created
        return dist.new_group(backend="fastcomm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--iters", type=int, default=500, help="all_reduces per timed block")
    ap.add_argument("--repeats", type=int, default=15, help="timed blocks per configuration")
    ap.add_argument("--numel", type=int, default=4)
    ap.add_argument("--stack-depth", type=int, default=20)
    ap.add_argument("--torch-hook", action="store_true")
    args = ap.parse_args()

    rank = int(os.environ["RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("fastcomm")
    meter = dist.new_group(backend="gloo")  # reductions of the timings, off the measured groups
    base = {"FASTCOMM_TRACE_PYTHON_STACK": "0"}
    configs: dict[str, tuple[dist.ProcessGroup, int]] = {
        "off": (make_group({**base, "FASTCOMM_TRACE_BUFFER_SIZE": "0"}), 0),
        "on": (make_group({**base, "FASTCOMM_TRACE_BUFFER_SIZE": "2000"}), 0),
        "stack": (
            make_group({"FASTCOMM_TRACE_BUFFER_SIZE": "2000", "FASTCOMM_TRACE_PYTHON_STACK": "1"}),
            args.stack_depth,
        ),
    }
    self_recording = getattr(dist.distributed_c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if args.torch_hook and isinstance(self_recording, set):
        self_recording.discard("fastcomm")
        configs["torch-hook"] = (
            make_group({**base, "FASTCOMM_TRACE_BUFFER_SIZE": "0", "TORCH_FR_BUFFER_SIZE": "2000"}),
            0,
        )
        self_recording.add("fastcomm")
    elif args.torch_hook and rank == 0:
        print(f"torch {torch.__version__} attaches no flight recorder hook: --torch-hook skipped")

    t = torch.ones(args.numel, device=args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def block(group: dist.ProcessGroup, depth: int) -> tuple[float, float]:
        def run() -> tuple[float, float]:
            dist.barrier(group=meter)
            sync()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                dist.all_reduce(t, group=group)
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            return (t1 - t0) / args.iters * 1e6, (t2 - t0) / args.iters * 1e6

        out: list[tuple[float, float]] = []
        nested(depth, lambda: out.append(run()))
        times = torch.tensor(out[0], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=meter)
        return float(times[0]), float(times[1])

    for name, (group, depth) in configs.items():  # warm-up: connections, rings filled
        for _ in range(3):
            block(group, depth)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name, (group, depth) in configs.items():
            results[name].append(block(group, depth))

    if rank == 0:
        world = dist.get_world_size()
        print(
            f"torch {torch.__version__}, {world} ranks, {args.device}, all_reduce of "
            f"{args.numel} float32, {args.repeats} x {args.iters} calls per configuration"
        )
        cols = ("issue", "total") if args.device == "cuda" else ("total",)
        # The median, and the fastest block (on a busy machine the least disturbed one).
        stats = {
            n: {
                kind: [f(r[i] for r in rs) for i in range(2)]
                for kind, f in (("median", statistics.median), ("min", min))
            }
            for n, rs in results.items()
        }
        print(
            f"{'config':<12}"
            + "".join(
                f"{c + ' ' + kind:>14}{'vs off':>9}" for c in cols for kind in ("median", "min")
            )
            + "   (us per call)"
        )
        for name in configs:
            line = f"{name:<12}"
            for c in cols:
                i = 0 if c == "issue" else 1
                for kind in ("median", "min"):
                    v, off = stats[name][kind][i], stats["off"][kind][i]
                    line += f"{v:>14.2f}{v - off:>+9.2f}"
            print(line)
        try:
            from torchext import _testing
        except ImportError:
            _testing = None
        if _testing is not None:
            x = torch.ones(args.numel)
            outs = [torch.ones(args.numel) for _ in range(8)]
            one = min(_testing.trace_cost(2000, [x], [x], 200_000) for _ in range(3))
            cross = min(
                _testing.trace_cost(2000, [x], [x], 100_000, cross_thread=True) for _ in range(3)
            )
            many = min(_testing.trace_cost(2000, [x], outs, 200_000) for _ in range(3))
            box: list[float] = []
            for _ in range(3):
                nested(
                    args.stack_depth,
                    lambda: box.append(
                        _testing.trace_cost(2000, [x], [x], 20_000, python_stack=True)
                    ),
                )
            stack = min(box)
            print(
                f"recorder calls alone (one thread): {one:.0f} ns per op (1 input, 1 output), "
                f"{many:.0f} ns (1 input, 8 outputs), {stack:.0f} ns with the Python stack; "
                f"{cross:.0f} ns when a second thread starts and completes the op, as a lane does "
                f"(both threads spin: meaningful on an idle machine only)"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
