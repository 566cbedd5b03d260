#!/usr/bin/env bash
# The prepared GPU check (issue 7): under 8 minutes on one GPU; everything goes under $OUT.
#   OUT=/tmp/gpu bash bench/gpu_check.sh          (the device tool sets $OUT itself)
# Sections: env, exactness per attention kernel (fp32 strict, bf16 reported), t(Q), lookahead vs
# generate on 10 HumanEval prompts, the overhead benchmark on the GPU, and LP over NCCL when
# more than one GPU is present, then bf16 vs int4 weight-only (torchao, bench/gpu_quant.py; never
# fatal, needs torchao installed). Each section's failure is recorded and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to a folder}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi || true
  python -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__)"
} > "$OUT/env.txt" 2>&1
python -c "import lp" 2>/dev/null || pip install -q --no-deps -e . >> "$OUT/env.txt" 2>&1 || true
timeout 420 python -m bench.gpu_check --out "$OUT/gpu" 2>&1 | tee "$OUT/gpu_check.log"
NGPU=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${NGPU:-0}" -gt 1 ]; then
  timeout 120 python launch/lp_run.py parallel.workers="$NGPU" parallel.backend=nccl decoding.W=15 decoding.N=5 \
    decoding.G=15 decoding.max_new_tokens=128 stream=false output="$OUT/lp_nccl.json" > "$OUT/lp_nccl.log" 2>&1 \
    || echo "LP over NCCL failed (see lp_nccl.log)" >> "$OUT/gpu_check.log"
else
  echo "one GPU: LP over NCCL not run" >> "$OUT/gpu_check.log"
fi
timeout 240 python -m bench.gpu_quant --out "$OUT/gpu" > "$OUT/gpu_quant.log" 2>&1 \
  || echo "int4 section failed or timed out (see gpu_quant.log)" >> "$OUT/gpu_check.log"
ls -la "$OUT" "$OUT/gpu" >> "$OUT/gpu_check.log" 2>&1
