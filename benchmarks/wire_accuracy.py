r"""What a lossy wire dtype does to training: the same DDP run once per FASTCOMM_WIRE_DTYPE.

A small character-level transformer learns the English text that ships with Python (the
``pydoc_data.topics`` documentation strings, ~0.47 MB; the last 10% held out), trained with DDP
over fastcomm on CPU tensors by 4 ranks as 2 simulated nodes x 2 ranks, so every gradient
all-reduce crosses a node boundary and is sent in the wire dtype there. Every wire dtype starts
from the same initial weights and sees the same batches in the same order.

    python benchmarks/wire_accuracy.py --out benchmarks/results/wire-accuracy-charlm-cpu-2x2
    python benchmarks/wire_accuracy.py --wires none bf16 int8 --out /tmp/wa

The script launches itself under ``torch.distributed.run`` (``--nproc``, default 4, as
``--nodes`` simulated nodes); under an existing torchrun it runs as one of its ranks:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/wire_accuracy.py ...

One launch measures every wire dtype: fastcomm reads FASTCOMM_WIRE_DTYPE when a process group
is created, so each wire dtype gets its own ``dist.new_group(backend="fastcomm")`` made with the
variable set. A wire dtype the installed fastcomm refuses is reported as skipped, with its error.

Per step: the training loss (mean over ranks, before the step's update) and, every
``--eval-every`` updates (from the initial weights on), the held-out loss. Per gradient all-reduce (a DDP communication hook, one call per bucket): the bucket is
all-reduced through the wire group, and its float32 inputs are also all-gathered through the
world group (wire ``none``) and summed in float64: the exact result. Recorded: the relative L2
error ||wire - exact|| / ||exact||, the largest element error relative to max |exact|, whether
every rank holds bit-identical results (a hash of the result, compared across ranks), and the
error bound of ``error_bound`` (2 nodes).

Writes ``OUT.json`` (every curve and statistic, versions, command), ``OUT.md`` (the table) and
``OUT.png`` (the loss curves; needs matplotlib). ``--replot OUT.json`` redraws the PNG and the
table from the JSON alone, with any Python that has matplotlib (torch is not needed).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from typing import Any

SCHEMA = "fastcomm-wire-accuracy/1"
DEFAULT_WIRES = ("none", "bf16", "fp16", "int8")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Per wire dtype, how far one rounding may move a vector x (see error_bound):
#   |q(x_i) - x_i| <= u * |x_i| + h * (max |x| over x_i's block) + a
# u: half the relative spacing of the format's significand; h: half a quantization step of a
# block-scaled format relative to its block's largest magnitude (int8: the power-of-two scale
# puts that magnitude in (63.5, 127] steps, so half a step is < 1/127 of it; scaled fp16: its
# subnormal spacing, for a scale that puts the block's largest magnitude at 1 or above); a: an
# absolute floor (none of the wires has one: bf16 has float32's range, fp16 and int8 are scaled).
# Wires not listed here have no stated bound.
WIRE_ROUNDING: dict[str, tuple[float, float, float]] = {
    "none": (0.0, 0.0, 0.0),
    "bf16": (2.0**-8, 0.0, 0.0),
    "fp16": (2.0**-11, 2.0**-24, 0.0),
    "int8": (0.0, 1.0 / 127.0, 0.0),
}
FLOAT32_U = 2.0**-24  # float32 additions of the partial sums, in every wire dtype
BOUND_SLACK = 1.25  # second-order terms: later roundings act on already rounded sums
BLOCK = 256  # elements per scale block of the block-scaled wires


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wires", nargs="+", default=list(DEFAULT_WIRES), help="wire dtypes to run")
    p.add_argument("--out", default=os.path.join(HERE, "results", "wire-accuracy-charlm-cpu-2x2"))
    p.add_argument("--nproc", type=int, default=4, help="ranks when launching itself")
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes (FASTCOMM_HOST_ID)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches per evaluation")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    p.add_argument("--context", type=int, default=64, help="characters per sequence")
    p.add_argument("--dim", type=int, default=96)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-mb", type=float, default=0.25, help="DDP bucket_cap_mb")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--replot", metavar="JSON", help="only redraw OUT.png and OUT.md from this JSON")
    return p.parse_args(argv)


# ---------------------------------------------------------------- launching


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Runs this script under torch.distributed.run with --nproc ranks on this host."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={args.nproc}", os.path.abspath(__file__), *argv,
    ]  # fmt: skip
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if glob.glob(os.path.join(ROOT, "torchext", "_C*.so")):  # built in place: this tree's
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env["WIRE_ACCURACY_COMMAND"] = shlex.join([sys.executable, *sys.argv])
    start = time.monotonic()
    rc = subprocess.run(cmd, env=env, check=False).returncode
    print(f"wire_accuracy: {time.monotonic() - start:.1f} s, exit {rc}", file=sys.stderr)
    return rc


# ---------------------------------------------------------------- data and model


def load_text() -> str:
    """Python's own documentation topics (pydoc_data ships with CPython), in a fixed order."""
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics))


def build_model(vocab: int, args: argparse.Namespace) -> Any:
    import torch
    from torch import nn

    class CharLM(nn.Module):
        """Token and position embeddings, pre-norm causal transformer blocks, a linear head."""

        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, args.dim)
            self.pos = nn.Parameter(torch.randn(args.context, args.dim) * 0.02)
            layer = nn.TransformerEncoderLayer(
                args.dim, args.heads, 4 * args.dim, dropout=0.0, batch_first=True, norm_first=True
            )
            self.blocks = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(args.dim)
            self.head = nn.Linear(args.dim, vocab)
            # A constant, not a buffer: DDP has nothing to synchronise but the gradients.
            self.mask = nn.Transformer.generate_square_subsequent_mask(args.context)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t = x.shape[1]
            h = self.tok(x) + self.pos[:t]
            h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
            return self.head(self.norm(h))

    return CharLM()


# ---------------------------------------------------------------- the error bound


def block_max_norm(x: Any) -> float:
    """||m||_2, where m_i bounds the largest |x_j| of any BLOCK-element block holding x_i.

    A block of BLOCK elements holding element i lies within the aligned blocks b-1, b, b+1 of
    i, wherever the wire's blocks start: m_i is the largest |x| over those three."""
    import torch

    n = x.numel()
    nb = (n + BLOCK - 1) // BLOCK
    a = torch.zeros(nb * BLOCK, dtype=x.dtype)
    a[:n] = x.abs().reshape(-1)
    bmax = a.view(nb, BLOCK).amax(dim=1)
    pad = torch.nn.functional.pad(bmax, (1, 1))
    m = torch.maximum(torch.maximum(pad[:-2], pad[1:-1]), pad[2:])
    counts = torch.full((nb,), float(BLOCK), dtype=x.dtype)
    counts[-1] = n - (nb - 1) * BLOCK
    return float((counts * m * m).sum().sqrt())


def error_bound(wire: str, partials: list[Any], exact: Any) -> float | None:
    """A bound on ||wire - exact||_2 / ||exact||_2 for one all-reduce over 2 nodes.

    On 2 nodes a value is rounded to the wire at most once per node partial p_n (the float32
    sum of a node's ranks: the ring rounds one of them per block, recursive doubling both) and
    once more as the sum s (so that every rank ends with the same values). A rounding moves
    each element by at most u|x_i| + h m_i + a (WIRE_ROUNDING), so in L2 norm by at most
    u||x|| + h||m(x)|| + a sqrt(N); the float32 additions add 2^-24 ||x|| each. Summed over
    the roundings p_1, p_2 and s, times BOUND_SLACK for second-order terms. With no
    cancellation between the nodes (sum_n ||p_n|| = ||s||) this is about 2.5 (2u + ...) for the
    floating formats: 2^-6.7 for bf16, 2^-9.7 for fp16; int8 adds the blocks'
    crest factors (max |x| over RMS): about 2.5 * 2 * crest / 127.
    None for a wire without a stated bound or more than 2 nodes."""
    if wire not in WIRE_ROUNDING or len(partials) != 2:
        return None
    u, h, a = WIRE_ROUNDING[wire]
    norm = float(exact.norm())
    if norm == 0.0:
        return None
    total = 0.0
    for x in (*partials, exact):
        total += (u + FLOAT32_U) * float(x.norm())
        if h:
            total += h * block_max_norm(x)
        total += a * math.sqrt(x.numel())
    return BOUND_SLACK * total / norm


# ---------------------------------------------------------------- the measured all-reduce


class HookState:
    """What the measuring hook needs, and what it records (one entry per bucket all-reduce)."""

    def __init__(self, wire: str, wire_group: Any, ref_group: Any, node_of: list[int]) -> None:
        self.wire = wire
        self.wire_group = wire_group
        self.ref_group = ref_group
        self.node_of = node_of
        self.step = 0
        self.records: dict[str, list[Any]] = {
            k: []
            for k in (
                "step", "bucket", "numel", "rel_l2", "max_rel", "identical", "bound", "kappa",
            )
        }  # fmt: skip


def digest(t: Any) -> int:
    """A 63-bit hash of a tensor's bytes (bit-identical tensors, same hash)."""
    h = hashlib.blake2b(t.contiguous().numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


def measured_allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]
    """DDP's default reduction (divide by the world size, then sum) through the wire group,
    measured against the exact sum of the same float32 inputs. No annotations: DDP compares
    a hook's annotations with its own types, and here they would be strings."""
    import torch
    import torch.distributed as dist

    buf = bucket.buffer()
    world = dist.get_world_size(state.ref_group)
    buf.div_(world)
    inputs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(inputs, buf, group=state.ref_group)
    dist.all_reduce(buf, group=state.wire_group)

    exact = torch.stack([x.double() for x in inputs]).sum(dim=0)
    nodes = sorted(set(state.node_of))
    partials = [
        torch.stack([inputs[r].double() for r in range(world) if state.node_of[r] == n]).sum(0)
        for n in nodes
    ]
    err = buf.double() - exact
    norm = float(exact.norm())
    amax = float(exact.abs().max())
    local = torch.tensor(
        [
            float(err.norm()) / norm if norm > 0 else float(err.norm()),
            float(err.abs().max()) / amax if amax > 0 else float(err.abs().max()),
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=state.ref_group)
    hashes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(hashes, torch.tensor([digest(buf)], dtype=torch.int64), group=state.ref_group)
    rec = state.records
    rec["step"].append(state.step)
    rec["bucket"].append(bucket.index())
    rec["numel"].append(buf.numel())
    rec["rel_l2"].append(float(local[0]))
    rec["max_rel"].append(float(local[1]))
    rec["identical"].append(all(int(h) == int(hashes[0]) for h in hashes))
    rec["bound"].append(error_bound(state.wire, partials, exact))
    rec["kappa"].append(sum(float(p.norm()) for p in partials) / norm if norm > 0 else None)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut


# ---------------------------------------------------------------- training


def batches(data: Any, step: int, count: int, args: argparse.Namespace, salt: int) -> Any:
    """`count` (input, target) windows drawn by a generator seeded from (seed, salt, step)."""
    import torch

    g = torch.Generator().manual_seed(args.seed * 1_000_003 + salt * 7919 + step)
    starts = torch.randint(0, data.numel() - args.context - 1, (count,), generator=g)
    idx = starts[:, None] + torch.arange(args.context + 1)
    seq = data[idx]
    return seq[:, :-1], seq[:, 1:]


def train_one(
    wire: str,
    wire_group: Any,
    ref_group: Any,
    node_of: list[int],
    train: Any,
    held: Any,
    vocab: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = build_model(vocab, args)
    ddp = DDP(model, process_group=ref_group, bucket_cap_mb=args.bucket_mb)
    state = HookState(wire, wire_group, ref_group, node_of)
    ddp.register_comm_hook(state, measured_allreduce_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.0)

    def held_out_loss() -> float:
        model.eval()
        total = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for i in range(rank, args.eval_batches, world):
                x, y = batches(held, i, args.batch, args, salt=1)
                logits = model(x)
                total[0] += float(F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1)))
                total[1] += 1
        model.train()
        dist.all_reduce(total, group=ref_group)
        return float(total[0] / total[1])

    losses: list[float] = []
    eval_steps: list[int] = []
    eval_losses: list[float] = []
    start = time.monotonic()
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            eval_steps.append(step)  # after `step` updates, as the training loss of `step`
            eval_losses.append(held_out_loss())
        if step == args.steps:
            break
        state.step = step
        x, y = batches(train, step, args.batch * world, args, salt=0)
        x, y = x[rank * args.batch : (rank + 1) * args.batch], y[rank * args.batch :][: args.batch]
        loss = F.cross_entropy(ddp(x).reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mean = loss.detach().double().reshape(1)
        dist.all_reduce(mean, group=ref_group)
        losses.append(float(mean) / world)
    seconds = time.monotonic() - start
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    hashes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(hashes, torch.tensor([digest(flat)], dtype=torch.int64), group=ref_group)
    return {
        "status": "ok",
        "loss": losses,
        "eval_step": eval_steps,
        "eval_loss": eval_losses,
        "allreduce": state.records,
        "params_identical": all(int(h) == int(hashes[0]) for h in hashes),
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": seconds,
    }


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """The table's numbers for one wire dtype."""
    if run.get("status") != "ok":
        return {}
    rec = run["allreduce"]
    rel = sorted(rec["rel_l2"])
    tail = max(1, len(run["loss"]) // 10)
    bounds = [(r, b) for r, b in zip(rec["rel_l2"], rec["bound"]) if b is not None]
    return {
        "allreduces": len(rel),
        "rel_l2_median": statistics.median(rel),
        "rel_l2_p99": rel[min(len(rel) - 1, math.ceil(0.99 * len(rel)) - 1)],
        "rel_l2_max": rel[-1],
        "max_rel_max": max(rec["max_rel"]),
        "identical_all": all(rec["identical"]),
        "within_bound": sum(r <= b for r, b in bounds) if bounds else None,
        "bounded": len(bounds),
        "bound_median": statistics.median(b for _, b in bounds) if bounds else None,
        "final_loss": statistics.fmean(run["loss"][-tail:]),
        "final_eval_loss": run["eval_loss"][-1],
        "params_identical": run["params_identical"],
    }


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, HERE)
    import bench_collectives  # next to this file, not an installed module

    node = bench_collectives.sim_node(args.nodes)
    os.environ["FASTCOMM_HOST_ID"] = f"simnode{node}"
    os.environ["FASTCOMM_WIRE_DTYPE"] = "none"
    torch.set_num_threads(1)
    import torchext

    dist.init_process_group("fastcomm")
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = dist.group.WORLD
    node_of: list[Any] = [None] * world
    dist.all_gather_object(node_of, node, group=ref)

    text = load_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.int64)
    cut = int(0.9 * data.numel())
    train, held = data[:cut], data[cut:]

    started = time.monotonic()
    runs: dict[str, Any] = {}
    for wire in args.wires:
        os.environ["FASTCOMM_WIRE_DTYPE"] = wire
        try:
            group = dist.new_group(backend="fastcomm")
        except Exception as e:  # noqa: BLE001  (the wire dtype refused: reported, not raised)
            runs[wire] = {"status": "skipped", "error": f"{type(e).__name__}: {e}"}
            if rank == 0:
                print(f"wire {wire}: skipped: {e}", file=sys.stderr, flush=True)
            continue
        finally:
            os.environ["FASTCOMM_WIRE_DTYPE"] = "none"
        runs[wire] = train_one(wire, group, ref, node_of, train, held, len(chars), args)
        runs[wire]["summary"] = summarize(runs[wire])
        dist.destroy_process_group(group)
        if rank == 0:
            s = runs[wire]["summary"]
            print(
                f"wire {wire}: {runs[wire]['seconds']:.1f} s, final loss {s['final_loss']:.4f}, "
                f"held-out {s['final_eval_loss']:.4f}, rel L2 median {s['rel_l2_median']:.2e} "
                f"max {s['rel_l2_max']:.2e}, identical {s['identical_all']}",
                file=sys.stderr,
                flush=True,
            )

    if rank == 0:
        sys.path.insert(0, HERE)
        from bench_collectives import _git_state

        result = {
            "schema": SCHEMA,
            "command": os.environ.get("WIRE_ACCURACY_COMMAND", shlex.join(sys.argv)),
            "args": vars(args),
            "layout": {"ranks": world, "nodes": args.nodes, "node_of_rank": node_of},
            "data": {
                "source": "pydoc_data.topics (CPython's documentation topics)",
                "characters": data.numel(),
                "vocab": len(chars),
                "train": train.numel(),
                "held_out": held.numel(),
            },
            "bound": {
                "wire_rounding_u_h_a": {k: list(v) for k, v in WIRE_ROUNDING.items()},
                "float32_u": FLOAT32_U,
                "slack": BOUND_SLACK,
                "block": BLOCK,
            },
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "torchext": getattr(torchext, "__version__", None),
                "git": _git_state(),
            },
            "host": {"machine": platform.machine(), "cores": os.cpu_count()},
            "seconds_total": time.monotonic() - started,
            "runs": runs,
        }
        write_outputs(result, args.out, draw=not args.no_plot)
    dist.destroy_process_group()


# ---------------------------------------------------------------- reports


def fmt(v: Any, spec: str = ".2e") -> str:
    return "-" if v is None else format(v, spec)


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [
        "# Wire dtype accuracy: DDP on a character-level language model, CPU, "
        f"{result['layout']['nodes']} simulated nodes x "
        f"{result['layout']['ranks'] // result['layout']['nodes']} ranks",
        "",
        f"- command: `{result['command']}`",
        f"- versions: torch {result['versions']['torch']}, torchext "
        f"{result['versions']['torchext']}, commit {(result['versions']['git'] or {}).get('commit')}",
        f"- data: {result['data']['source']}, {result['data']['characters']} characters "
        f"({result['data']['vocab']} distinct), last 10% held out",
        f"- model: transformer, {a['layers']} layers, width {a['dim']}, {a['heads']} heads, "
        f"context {a['context']}; AdamW lr {a['lr']}; {a['batch']} sequences per rank and step; "
        f"{a['steps']} steps; DDP buckets of {a['bucket_mb']} MB",
        "- error per all-reduce: the wire group's result against the float64 sum of the same "
        "float32 inputs (DDP's reduction: each rank's bucket divided by the world size, summed); "
        "the largest over the ranks",
        "- bound: `error_bound` in benchmarks/wire_accuracy.py, per all-reduce",
        "",
        "| wire | final loss | held-out loss | all-reduces | rel. L2 error median | p99 | max "
        "| max element error / max abs | within bound | identical on all ranks | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for wire, run in result["runs"].items():
        if run.get("status") != "ok":
            lines.append(f"| {wire} | skipped: {run.get('error', '')[:160]} |" + " |" * 9)
            continue
        s = run["summary"]
        within = f"{s['within_bound']}/{s['bounded']}" if s["bounded"] else "-"
        lines.append(
            f"| {wire} | {s['final_loss']:.4f} | {s['final_eval_loss']:.4f} | {s['allreduces']} "
            f"| {fmt(s['rel_l2_median'])} | {fmt(s['rel_l2_p99'])} | {fmt(s['rel_l2_max'])} "
            f"| {fmt(s['max_rel_max'])} | {within} "
            f"| {'yes' if s['identical_all'] and s['params_identical'] else 'no'} "
            f"| {run['seconds']:.0f} |"
        )
    lines += [
        "",
        "final loss: mean training loss of the last 10% of the steps; held-out loss: after the last "
        "update. s: training time of the wire dtype (the measurement included).",
        "",
    ]
    return "\n".join(lines)


def smooth(values: list[float], width: int) -> list[float]:
    """Trailing mean over `width` values (fewer at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - width] if i >= width else 0.0)
        out.append(acc / min(i + 1, width))
    return out


def plot(result: dict[str, Any], path: str) -> bool:
    """Loss curves per wire dtype, their difference from float32's, and the error per
    all-reduce; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"warning: matplotlib is not installed, skipping {path}", file=sys.stderr)
        return False
    runs = {w: r for w, r in result["runs"].items() if r.get("status") == "ok"}
    base = runs.get("none")
    fig, (ax_loss, ax_diff, ax_err) = plt.subplots(1, 3, figsize=(18, 5))
    width = max(1, result["args"]["steps"] // 20)
    for i, (wire, run) in enumerate(runs.items()):
        color = f"C{i}"
        name = "float32" if wire == "none" else wire
        ax_loss.plot(run["loss"], color=color, alpha=0.3, linewidth=0.7)
        ax_loss.plot(
            run["eval_step"], run["eval_loss"], color=color, marker="o", markersize=3, label=name
        )
        if base is not None and wire != "none":
            diff = [a - b for a, b in zip(run["loss"], base["loss"])]
            ax_diff.plot(smooth(diff, width), color=color, label=f"{name}: training")
            ax_diff.plot(
                run["eval_step"],
                [a - b for a, b in zip(run["eval_loss"], base["eval_loss"])],
                color=color, marker="o", markersize=3, linestyle=":", label=f"{name}: held-out",
            )  # fmt: skip
        rec = run["allreduce"]
        errs = [max(e, 1e-12) for e in rec["rel_l2"]]
        ax_err.scatter(rec["step"], errs, s=4, color=color, alpha=0.5, label=name)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy (nats per character)")
    ax_loss.set_title("loss: held-out (dots), training (thin)")
    ax_loss.legend(fontsize=8)
    ax_diff.axhline(0.0, color="black", linewidth=0.6)
    ax_diff.set_xlabel("step")
    ax_diff.set_ylabel("loss minus float32's (nats per character)")
    ax_diff.set_title(f"difference from float32 (training: mean of {width} steps)")
    ax_diff.legend(fontsize=8)
    ax_err.set_yscale("log")
    ax_err.set_xlabel("step")
    ax_err.set_ylabel("||wire - exact|| / ||exact||")
    ax_err.set_title("error of each gradient all-reduce (per bucket) against float64")
    ax_err.legend(fontsize=8, markerscale=3)
    lay = result["layout"]
    fig.suptitle(
        f"DDP over fastcomm, {lay['nodes']} simulated nodes x {lay['ranks'] // lay['nodes']} "
        "CPU ranks: a character-level transformer on pydoc_data.topics, the same initial weights "
        "and batches for every wire dtype"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_outputs(result: dict[str, Any], out: str, draw: bool = True) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(markdown(result))
    wrote = plot(result, out + ".png") if draw else False
    print(
        f"wrote {out}.json, {out}.md" + (f", {out}.png" if wrote else " (no PNG)"), file=sys.stderr
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            result = json.load(f)
        out = args.replot.removesuffix(".json")
        with open(out + ".md", "w") as f:
            f.write(markdown(result))
        return 0 if plot(result, out + ".png") else 1
    if "RANK" not in os.environ:
        return launch(args, argv)
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
