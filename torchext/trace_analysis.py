"""Names the rank that hangs, from the flight recorder dumps of every rank.

    python -m torchext.trace_analysis /tmp/fastcomm_trace_rank_ [--json]
    python -m torchext.trace_analysis <directory of dumps> [--prefix fastcomm_trace_rank_]

The argument is a directory (every file in it that holds a dump is read) or a dump file
prefix, as FASTCOMM_TRACE_FILE names it (every ``<prefix><rank>``). Dumps are those of
fastcomm's flight recorder or of PyTorch's (same format). For each process group it reports

- the first collective that some member ranks issued and others never reached, when the ranks
  that reached it did not complete it: the ranks that never reached it are the culprits;
- the first collective whose op, sizes, dtypes, reduce op or root differ between the ranks:
  the ranks that differ from the majority are the culprits (with two ranks, both are named);
- sends that wait for a receive the peer never posted (and receives without a send);

and per rank the last collective it completed and the first it did not. The exit status is 1
when a culprit was found, 0 when the dumps show none, 2 when there are no dumps to read.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import pickle
import re
import sys
from collections import Counter, defaultdict
from typing import Any, Optional, Sequence

__all__ = ["Finding", "Report", "load_dumps", "analyse", "main"]

# Ops whose per-rank buffers differ by design: only these fields are compared.
_GATHER_LIKE = {"gather"}
_SCATTER_LIKE = {"scatter"}
_UNEVEN = {"all_to_all", "all_to_all_single", "all_to_all_v_single"}


@dataclasses.dataclass
class Finding:
    """One thing that is wrong in a group: ``kind`` is "not_reached", "mismatch" or "p2p"."""

    kind: str
    group: str  # the group's name
    group_desc: str
    seq: int  # collective sequence number (p2p: the sender's or receiver's p2p sequence number)
    op: str
    culprits: list[int]  # global ranks
    detail: str

    def describe(self) -> str:
        return f"group {self.group} ({self.group_desc}) {self.detail}"


@dataclasses.dataclass
class RankState:
    rank: int
    reason: str  # why the rank dumped
    last_completed: Optional[str]  # e.g. "group 0 #6 all_reduce"
    first_pending: Optional[str]  # e.g. "group 0 #7 all_reduce (started)"


@dataclasses.dataclass
class Report:
    dumps: dict[int, str]  # rank -> file
    findings: list[Finding]
    ranks: list[RankState]
    notes: list[str]

    @property
    def culprits(self) -> list[int]:
        """Every rank some finding blames, in order of appearance."""
        out: list[int] = []
        for f in self.findings:
            out += [r for r in f.culprits if r not in out]
        return out

    def text(self) -> str:
        lines = [
            f"{len(self.dumps)} dumps (ranks {_ranks_text(sorted(self.dumps))})",
        ]
        lines += [f"note: {n}" for n in self.notes]
        if self.findings:
            lines += [f.describe() for f in self.findings]
        else:
            lines.append("no rank missing from a collective, no mismatch")
        lines.append("per rank: last completed collective | first not completed | dumped on")
        for s in self.ranks:
            lines.append(
                f"  rank {s.rank}: {s.last_completed or '-'} | {s.first_pending or '-'} | "
                f"{s.reason}"
            )
        if self.culprits:
            first = self.findings[0]
            lines.append(
                f"culprit: rank(s) {_ranks_text(self.culprits)} "
                f"(first: group {first.group} #{first.seq} {first.op}, {first.kind})"
            )
        return "\n".join(lines)


def _ranks_text(ranks: Sequence[int]) -> str:
    return "[" + ", ".join(str(r) for r in ranks) + "]"


def _op_of(entry: dict[str, Any]) -> str:
    name = entry["profiling_name"].rpartition(":")[2]
    return name.split(" ")[0]


def _state(entry: dict[str, Any]) -> str:
    return str(entry.get("state", "?"))


def _signature(entry: dict[str, Any]) -> tuple[Any, ...]:
    """What must agree across the ranks of collective ``entry``."""
    op = _op_of(entry)
    ins = (repr(entry.get("input_sizes")), tuple(entry.get("input_dtypes", ())))
    outs = (repr(entry.get("output_sizes")), tuple(entry.get("output_dtypes", ())))
    extra = (entry.get("reduce_op"), entry.get("root"))
    if op in _UNEVEN:
        dtypes = set(entry.get("input_dtypes", ())) | set(entry.get("output_dtypes", ()))
        return (op, tuple(sorted(dtypes)))
    if op in _GATHER_LIKE:
        return (op, ins, extra)
    if op in _SCATTER_LIKE:
        return (op, outs, extra)
    return (op, ins, outs, extra)


def _sizes_text(sizes: list[list[int]]) -> str:
    """[[4]] -> "[4]", [[4], [4]] -> "2x[4]", else the list."""
    if len(sizes) == 1:
        return str(list(sizes[0]))
    if sizes and all(s == sizes[0] for s in sizes):
        return f"{len(sizes)}x{list(sizes[0])}"
    return str([list(s) for s in sizes])


def _signature_text(entry: dict[str, Any]) -> str:
    """E.g. "all_reduce [4] Float SUM", "all_gather in [4] out 2x[4] Int"."""
    parts = [_op_of(entry)]
    ins, outs = entry.get("input_sizes") or [], entry.get("output_sizes") or []
    if ins and ins == outs:
        parts.append(_sizes_text(ins))
    else:
        if ins:
            parts.append("in " + _sizes_text(ins))
        if outs:
            parts.append("out " + _sizes_text(outs))
    dtypes = sorted(set(entry.get("input_dtypes", ())) | set(entry.get("output_dtypes", ())))
    if dtypes:
        parts.append("/".join(dtypes))
    if entry.get("reduce_op"):
        parts.append(str(entry["reduce_op"]))
    if entry.get("root") is not None:
        parts.append(f"root {entry['root']}")
    return " ".join(parts)


def load_dumps(target: str, prefix: Optional[str] = None) -> tuple[dict[int, dict], list[str]]:
    """Every dump under ``target`` (a directory, or a file prefix): rank -> dump, and notes
    about files that were skipped."""
    notes: list[str] = []
    if os.path.isdir(target):
        folder, start = target, prefix or ""
    else:
        folder, start = os.path.dirname(target) or ".", os.path.basename(target)
    if not os.path.isdir(folder):
        return {}, [f"{folder} is not a directory"]
    dumps: dict[int, dict] = {}
    for name in sorted(os.listdir(folder)):
        m = re.match(re.escape(start) + r".*?(\d+)$", name)
        path = os.path.join(folder, name)
        if not m or not os.path.isfile(path):
            continue
        try:
            with open(path, "rb") as f:
                dump = pickle.load(f)
        except Exception as e:  # not a dump (or a partial one): say so, read the rest
            notes.append(f"{name}: not a dump ({type(e).__name__})")
            continue
        if not isinstance(dump, dict) or "entries" not in dump and "pg_config" not in dump:
            notes.append(f"{name}: not a flight recorder dump")
            continue
        rank = int(dump.get("rank", m.group(1)))
        dump["_file"] = path
        if rank in dumps:
            notes.append(f"rank {rank}: two dumps, {dumps[rank]['_file']} and {path}; the later")
            if dump.get("time_ns", 0) < dumps[rank].get("time_ns", 0):
                continue
        dumps[rank] = dump
    return dumps, notes


def analyse(dumps: dict[int, dict], notes: Optional[list[str]] = None) -> Report:
    """The findings of :func:`load_dumps`'s dumps (see the module's docstring)."""
    notes = list(notes or [])
    # Groups: name -> (desc, global ranks); entries per (group, rank).
    groups: dict[str, tuple[str, list[int]]] = {}
    colls: dict[str, dict[int, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    p2p: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for rank, dump in dumps.items():
        for name, cfg in dump.get("pg_config", {}).items():
            ranks = cfg.get("ranks", "[]")
            ranks = ast.literal_eval(ranks) if isinstance(ranks, str) else list(ranks)
            known = groups.get(name)
            if known is not None and sorted(known[1]) != sorted(ranks):
                notes.append(f"group {name}: ranks {ranks} on rank {rank}, {known[1]} elsewhere")
            groups.setdefault(name, (cfg.get("desc", "undefined"), list(ranks)))
        for e in dump.get("entries", []):
            name = e["process_group"][0]
            if e.get("is_p2p"):
                p2p[name][rank].append(e)
            else:
                colls[name][rank][int(e["collective_seq_id"])] = e

    findings: list[Finding] = []
    for name, (desc, members) in groups.items():
        dumped = [r for r in members if r in dumps]
        absent = [r for r in members if r not in dumps]
        if absent:
            notes.append(f"group {name}: no dump from ranks {_ranks_text(absent)}")
        if not dumped:
            continue
        findings += _collective_findings(name, desc, dumped, colls[name])
        findings += _p2p_findings(name, desc, members, dumped, p2p[name])

    states = [_rank_state(rank, dumps[rank], groups) for rank in sorted(dumps)]
    return Report(
        dumps={r: d["_file"] for r, d in dumps.items()},
        findings=findings,
        ranks=states,
        notes=notes,
    )


def _collective_findings(
    name: str, desc: str, dumped: list[int], by_rank: dict[int, dict[int, dict]]
) -> list[Finding]:
    out: list[Finding] = []
    last = {r: max(by_rank[r], default=0) for r in dumped}
    first = {r: min(by_rank[r], default=0) for r in dumped}

    # Ranks that never reached a collective the others are stuck in.
    top = max(last.values())
    for seq in range(min(last.values()) + 1, top + 1):
        reached = [r for r in dumped if last[r] >= seq and seq in by_rank[r]]
        behind = [r for r in dumped if last[r] < seq]
        if not reached or not behind:
            continue
        if any(_state(by_rank[r][seq]) == "completed" for r in reached):
            continue  # dumped at different times, not a hang
        e = by_rank[reached[0]][seq]
        states = sorted({_state(by_rank[r][seq]) for r in reached})
        lasts = ", ".join(
            (
                f"rank {r} #{last[r]} {_op_of(by_rank[r][last[r]])} {_state(by_rank[r][last[r]])}"
                if last[r] in by_rank[r]
                else f"rank {r} none"
            )
            for r in behind
        )
        out.append(
            Finding(
                kind="not_reached",
                group=name,
                group_desc=desc,
                seq=seq,
                op=_op_of(e),
                culprits=behind,
                detail=(
                    f"#{seq} {_signature_text(e)}: rank(s) {_ranks_text(behind)} never reached "
                    f"it (last: {lasts}); rank(s) {_ranks_text(reached)} wait in it "
                    f"({'/'.join(states)})"
                ),
            )
        )
        break

    # Ranks that disagree on a collective all of them issued.
    lo, hi = max(first.values()), min(last.values())
    for seq in range(lo, hi + 1):
        present = [r for r in dumped if seq in by_rank[r]]
        if len(present) < 2:
            continue
        sigs = {r: _signature(by_rank[r][seq]) for r in present}
        counts = Counter(sigs.values())
        if len(counts) == 1:
            continue
        (common, n_common), *rest = counts.most_common()
        tie = rest and rest[0][1] == n_common
        odd = present if tie else [r for r in present if sigs[r] != common]
        variants = "; ".join(
            f"rank(s) {_ranks_text([r for r in present if sigs[r] == sig])} "
            f"{_signature_text(by_rank[next(r for r in present if sigs[r] == sig)][seq])}"
            for sig, _ in counts.most_common()
        )
        e = by_rank[present[0]][seq]
        out.append(
            Finding(
                kind="mismatch",
                group=name,
                group_desc=desc,
                seq=seq,
                op=_op_of(e),
                culprits=odd,
                detail=(
                    f"#{seq}: the ranks disagree: {variants}"
                    + (" (no majority: every rank named)" if tie else "")
                ),
            )
        )
        break
    return out


def _p2p_findings(
    name: str, desc: str, members: list[int], dumped: list[int], by_rank: dict[int, list[dict]]
) -> list[Finding]:
    """Point-to-point ops that wait for a counterpart the peer never posted. Peers are
    group ranks in the names ("send 0->1"), members[i] is group rank i's global rank."""
    out: list[Finding] = []
    sends: dict[tuple[int, int], list[dict]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for rank in dumped:
        for e in by_rank.get(rank, []):
            meta = e["profiling_name"].rpartition(":")[2].split(" ")
            if len(meta) != 2:
                continue
            if _op_of(e) == "send" and "->" in meta[1]:
                s, d = meta[1].split("->")
                sends[(int(s), int(d))].append(e)
            elif _op_of(e) == "recv" and "<-" in meta[1]:
                d, s = meta[1].split("<-")
                if s != "?":
                    recvs[(int(s), int(d))].append(e)
    for s, d in sorted(set(sends) | set(recvs)):
        if not (0 <= s < len(members) and 0 <= d < len(members)):
            continue
        gs, gd = members[s], members[d]
        if gs not in dumped or gd not in dumped:
            continue
        ns, nr = len(sends[(s, d)]), len(recvs[(s, d)])
        if ns == nr:
            continue
        more, waiting_rank, peer = (sends, gs, gd) if ns > nr else (recvs, gd, gs)
        extra = more[(s, d)][min(ns, nr)]
        if _state(extra) == "completed":
            continue  # the ring dropped the counterpart, or the dumps are of different times
        op = _op_of(extra)
        out.append(
            Finding(
                kind="p2p",
                group=name,
                group_desc=desc,
                seq=int(extra["p2p_seq_id"]),
                op=op,
                culprits=[peer],
                detail=(
                    f"p2p #{extra['p2p_seq_id']}: rank {waiting_rank}'s {_signature_text(extra)} "
                    f"({_state(extra)}) has no matching {'recv' if op == 'send' else 'send'} on "
                    f"rank {peer}"
                ),
            )
        )
    return out


def _rank_state(rank: int, dump: dict, groups: dict[str, tuple[str, list[int]]]) -> RankState:
    done = None
    pending = None
    for e in dump.get("entries", []):
        if e.get("is_p2p"):
            continue
        label = f"group {e['process_group'][0]} #{e['collective_seq_id']} {_op_of(e)}"
        if _state(e) == "completed":
            if done is None or e["time_created_ns"] >= done[0]:
                done = (e["time_created_ns"], label)
        elif pending is None or e["time_created_ns"] < pending[0]:
            pending = (e["time_created_ns"], f"{label} ({_state(e)})")
    # The rank's own failure tells more than a later dump a peer asked for.
    reason = str(dump.get("failure") or dump.get("dump_reason") or "?")
    if dump.get("failure"):
        reason = "its failure: " + reason.split(": ", 1)[-1]
    return RankState(
        rank=rank,
        reason=reason if len(reason) <= 120 else reason[:117] + "...",
        last_completed=done[1] if done else None,
        first_pending=pending[1] if pending else None,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m torchext.trace_analysis",
        description="Names the rank that hangs, from every rank's flight recorder dump.",
    )
    ap.add_argument("target", help="a directory of dumps, or the dump file prefix")
    ap.add_argument("--prefix", help="in a directory, read only files starting with this")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    dumps, notes = load_dumps(args.target, args.prefix)
    if not dumps:
        print(f"no flight recorder dumps found at {args.target}", file=sys.stderr)
        for n in notes:
            print(f"note: {n}", file=sys.stderr)
        return 2
    report = analyse(dumps, notes)
    if args.json:
        print(json.dumps(dataclasses.asdict(report) | {"culprits": report.culprits}, indent=1))
    else:
        print(report.text())
    return 1 if report.culprits else 0


if __name__ == "__main__":
    sys.exit(main())
