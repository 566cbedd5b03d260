#!/usr/bin/env bash
# The prepared GPU check (issue 7): under 8 minutes on one GPU; everything goes under $OUT.
#   OUT=/tmp/gpu bash bench/gpu_check.sh          (the device tool sets $OUT itself)
# Sections: env, exactness per attention kernel (fp32 strict, bf16 reported), t(Q), lookahead vs
# generate on 10 HumanEval prompts, the overhead benchmark on the GPU, and LP over NCCL when
# more than one GPU is present, then the (lp, tp) mesh over NCCL (SmolLM2 on tp=3 when the GPU
# count divides by 3, else a tiny random Llama with SmolLM2's tokenizer on tp=2), its greedy
# output compared with transformers generate, the memory plan vs the device memory a bf16 load took (and the
# sharded load of a ~480M checkpoint over every GPU), then bf16 vs int4 weight-only (torchao,
# bench/gpu_quant.py; never fatal, needs torchao installed). Each section's failure is recorded
# and the next one runs.
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
  # the mesh: LP x TP over NCCL
  if [ $((NGPU % 3)) -eq 0 ]; then TP=3; MODEL_ARGS=(); else TP=2; MODEL_ARGS=(model.path="$OUT/tiny_tp"); fi
  if [ "$TP" = 2 ]; then
    python -c "
import shutil, sys; from pathlib import Path
from tests.helpers import make_tiny_model; from lp.model.loader import resolve_model_path
out = Path(sys.argv[1]); make_tiny_model(vocab=49152).save_pretrained(out)
src = resolve_model_path('smollm2', None)
[shutil.copy(src / f, out / f) for f in ('tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja') if (src / f).exists()]
" "$OUT/tiny_tp" >> "$OUT/lp_mesh.log" 2>&1
  fi
  timeout 150 python launch/lp_run.py parallel.workers=$((NGPU / TP)) parallel.tp=$TP parallel.backend=nccl \
    "${MODEL_ARGS[@]}" decoding.W=15 decoding.N=5 decoding.G=15 decoding.max_new_tokens=64 stream=false \
    output="$OUT/lp_mesh.json" >> "$OUT/lp_mesh.log" 2>&1 \
    && timeout 120 python -c "
import json, sys, torch; from lp.model.loader import load_model, resolve_model_path
r = json.load(open(sys.argv[1])); path = r['model']
m, tok = load_model(path, r['dtype'], 'cuda'); ids = torch.tensor([r['prompt_ids']], device='cuda')
ref = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=64,
                 eos_token_id=[tok.eos_token_id])[0, ids.shape[1]:].tolist()
print('mesh', r['workers'], 'x tp', r['tp'], 'equals generate:', r['output_ids'] == ref, r['tokens_per_second'], 'tok/s')
" "$OUT/lp_mesh.json" >> "$OUT/gpu_check.log" 2>&1 \
    || echo "LP x TP mesh over NCCL failed (see lp_mesh.log)" >> "$OUT/gpu_check.log"
else
  echo "one GPU: LP over NCCL not run" >> "$OUT/gpu_check.log"
fi
# sharded loading (issue 24): the memory plan against what loading really took on the device (SmolLM2, bf16), then
# with more than one GPU a ~480M checkpoint on LP 1 x TP k (k = every GPU) over NCCL, bf16, device memory per rank
timeout 120 python -c "
import json, sys, torch; from lp.model.loader import resolve_dtype, resolve_model_path; from lp.parallel.memory import plan_memory
from lp.parallel.tp import load_for
path = resolve_model_path('smollm2', None); dev = torch.device('cuda')
plan = plan_memory(path, resolve_dtype('bfloat16', dev), dev, 1, max_len=4096, step_rows=64)
m, _ = load_for(path, 'bfloat16', 'cuda', 'none', None, tokenizer=False)
print('memory plan weights', plan.weights / 2**20, 'MB; allocated after load', torch.cuda.memory_allocated() / 2**20, 'MB;',
      'dtypes', sorted({str(p.dtype) for p in m.parameters()}))
" >> "$OUT/gpu_check.log" 2>&1 || echo "memory plan check failed" >> "$OUT/gpu_check.log"
if [ "${NGPU:-0}" -gt 1 ]; then
  timeout 240 python -m bench.tp_memory --device cuda --dtype bfloat16 --tps "1,$NGPU" --rounds 1 --ckpt /tmp/ckpt_480m \
    --out "$OUT/tp_memory" > "$OUT/tp_memory.log" 2>&1 || echo "sharded load over NCCL failed (see tp_memory.log)" >> "$OUT/gpu_check.log"
fi
timeout 240 python -m bench.gpu_quant --out "$OUT/gpu" > "$OUT/gpu_quant.log" 2>&1 \
  || echo "int4 section failed or timed out (see gpu_quant.log)" >> "$OUT/gpu_check.log"
ls -la "$OUT" "$OUT/gpu" >> "$OUT/gpu_check.log" 2>&1
