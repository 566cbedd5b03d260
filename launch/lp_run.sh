#!/usr/bin/env bash
# torchrun around lp.generate. Knobs: NGPU (processes per node, default 2), TP (tensor-parallel
# degree of each LP worker, default 1; LP workers = NGPU x NNODES / TP), NNODES, NODE_RANK,
# RDZV (host:port of node 0), THREADS (CPU threads per process). Hydra overrides follow.
#   NGPU=8 bash launch/lp_run.sh decoding.W=15 decoding.G=15
#   NGPU=8 TP=2 bash launch/lp_run.sh                       # LP 4 x TP 2
#   NNODES=2 NODE_RANK=0 RDZV=node0:29500 NGPU=8 bash launch/lp_run.sh
set -euo pipefail
NGPU=${NGPU:-2}
NNODES=${NNODES:-1}
TP=${TP:-1}
export OMP_NUM_THREADS=${THREADS:-1}
export LP_RUN_DIR=${LP_RUN_DIR:-outputs/lp_run/$(date +%Y-%m-%d_%H-%M-%S)}
if [ "$NNODES" = 1 ]; then
  NODE_FLAGS=(--standalone)
else
  NODE_FLAGS=(--nnodes "$NNODES" --node-rank "${NODE_RANK:?set NODE_RANK}" --rdzv-backend c10d --rdzv-endpoint "${RDZV:?set RDZV=host:port}")
fi
exec torchrun "${NODE_FLAGS[@]}" --nproc-per-node "$NGPU" -m lp.generate parallel.workers=$((NGPU * NNODES / TP)) parallel.tp="$TP" "$@"
