"""Run by every rank of test_netbed.py under torchrun, one torchrun per node of the testbed.

On the fastcomm backend: every collective x dtype x op case of test_collectives.py, DDP parity
with gloo (test_ddp.py), then one bulk all_reduce whose bytes must cross the link. Each rank
writes what it found to <out>/rank<r>.json (argv[1]).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import torchext  # noqa: F401 - registers the fastcomm backend
from test_collectives import CASES, run_cases
from test_ddp import ddp_parity_fn

PG_TIMEOUT_S = 60.0
BULK_ELEMENTS = 4 << 20  # float32: 16 MiB


def main() -> int:
    out = sys.argv[1]
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("fastcomm", timeout=timedelta(seconds=PG_TIMEOUT_S))
    result: dict = {"rank": rank, "host_id": os.environ.get("FASTCOMM_HOST_ID")}
    result["cases"] = run_cases(rank, ws, "cpu", [c.name for c in CASES], PG_TIMEOUT_S + 20.0)
    try:
        ddp_parity_fn(rank, ws, "cpu", "gloo")
        result["ddp"] = None
    except Exception:
        result["ddp"] = traceback.format_exc()
    # Node k's sum depends on every element of the other node's inputs: an exact all_reduce
    # of S bytes between two nodes sends at least S bytes each way over the link.
    g = torch.Generator().manual_seed(rank)
    mine = torch.randint(-1000, 1000, (BULK_ELEMENTS,), generator=g).float()
    t = mine.clone()
    dist.all_reduce(t)
    expected = sum(
        torch.randint(-1000, 1000, (BULK_ELEMENTS,), generator=torch.Generator().manual_seed(r))
        for r in range(ws)
    ).float()
    result["bulk_bytes"] = t.numel() * t.element_size()
    result["bulk_ok"] = bool(torch.equal(t, expected))
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
