#!/usr/bin/env bash
# The main job: DDP training over backend "fastcomm" with torchrun, on the GPUs
# when there are any (one rank per GPU), else on 4 CPU ranks.
source "$(dirname "$0")/env.sh"
NPROC="${NPROC:-$("$PY" -c 'import torch; print(torch.cuda.device_count() or 4)')}"
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" \
  examples/ddp_train.py --backend fastcomm "$@"
