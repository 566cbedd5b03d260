#!/usr/bin/env bash
# The prepared GPU check (issues 7, 37): one call of the device tool on one H200, under 480 s of sections.
#   on the GPU machine (the device tool sets $OUT; carry .gpu_kit/load1, and the model's other loads in the
#   calls before: python -m bench.gpu_kit build writes them here, docs/gpu.md):
#     bash bench/gpu_check.sh
#   here, the CPU rehearsal (a fresh venv that sees only the GPU image's packages, the kit installed with
#   --no-index, the same sections at CPU sizes):
#     bash bench/gpu_check.sh --rehearse [OUT]          (SECTIONS=env,exact to run fewer)
# 1. bench.gpu_kit assemble: the carried loads staged (they outlive a call while the machine is warm), every
#    file's sha256 checked, the model joined and checked once all its parts are there;
# 2. pip install --no-index from the kit's wheels only, and what it installed (install.txt, installed.txt);
# 3. python -m bench.gpu_check: sections cheapest first, each in its own process under its own time-out,
#    each appending its JSON to $OUT/sections.jsonl the moment it ends (bench/gpu_check.py says which);
#    $OUT holds 6 files (env.txt kit.txt install.txt installed.txt gpu_check.log sections.jsonl): the
#    device tool returns 8 at most; the per-section logs stay in $WORK.
# GPU_CHECK_MORE=1 on a machine with several GPUs then runs the older multi-GPU parts (LP and LP x TP over
# NCCL, the sharded load, int4): beyond the 480 s budget, a call of their own.
set -uo pipefail
cd "$(dirname "$0")/.."
REHEARSE=0
if [ "${1:-}" = "--rehearse" ]; then REHEARSE=1; shift; fi
FLAGS=()
if [ "$REHEARSE" = 1 ]; then
  OUT=${1:-${OUT:-/tmp/lp_rehearse}}
  STAGE=${LP_KIT_STAGE:-/tmp/lp_rehearse_stage}
  VENV=${LP_REHEARSE_VENV:-/tmp/lp_rehearse_venv}
  rm -rf "$OUT" && mkdir -p "$OUT"
  python -m bench.gpu_kit image-venv "$VENV" > "$OUT/image.txt" || { echo "[gpu_check] no image venv"; exit 2; }
  PY=$VENV/bin/python
  # .gpu_kit/host: this machine's builds of the kit's few cp312-only wheels (same names and versions)
  FIND=(--find-links "$STAGE/wheels" --find-links .gpu_kit/host)
  FLAGS=(--rehearse)
  LIMIT=2400  # the rehearsal's time-outs are the GPU's x5 (bench/gpu_check.py REHEARSE_SCALE)
else
  OUT=${OUT:?set OUT to a folder}
  STAGE=${LP_KIT_STAGE:-$PWD/.gpu_kit_stage}
  PY=$(command -v python || command -v python3)
  FIND=(--find-links "$STAGE/wheels")
  LIMIT=490
fi
WORK=${LP_CHECK_WORK:-${TMPDIR:-/tmp}/lp_gpu_check}  # per-section JSON and logs: $OUT takes 8 files back
rm -rf "$WORK" && mkdir -p "$OUT" "$WORK"
export LP_KIT_STAGE=$STAGE PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
T0=$(date +%s)
{
  nvidia-smi || true
  "$PY" -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__)"
} > "$OUT/env.txt" 2>&1
"$PY" -m bench.gpu_kit assemble --kit .gpu_kit --stage "$STAGE" 2>&1 | tee "$OUT/kit.txt"
KIT=${PIPESTATUS[0]}
if [ "$KIT" = 2 ] || [ ! -d "$STAGE/wheels" ]; then
  echo "[gpu_kit] no usable kit (exit $KIT): python -m bench.gpu_kit build here, carry .gpu_kit/load1" | tee -a "$OUT/kit.txt"
  exit 2
fi
"$PY" -m pip list --format=freeze 2>/dev/null | sort > "$WORK/pip_before.txt"
PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --no-index --disable-pip-version-check "${FIND[@]}" \
  hydra-core omegaconf llguidance gguf fastapi uvicorn jsonschema prometheus-client typing-extensions 2>&1 | tee "$OUT/install.txt"
if [ "${PIPESTATUS[0]}" != 0 ]; then echo "[gpu_check] install from the kit failed (install.txt)"; exit 2; fi
"$PY" -m pip list --format=freeze 2>/dev/null | sort > "$WORK/pip_after.txt"
comm -13 "$WORK/pip_before.txt" "$WORK/pip_after.txt" > "$OUT/installed.txt"
echo "[gpu_check] installed from the kit ($(($(date +%s) - T0)) s so far): $(tr '\n' ' ' < "$OUT/installed.txt")"
timeout "$LIMIT" "$PY" -m bench.gpu_check --out "$WORK" --jsonl "$OUT/sections.jsonl" "${FLAGS[@]}" ${SECTIONS:+--sections "$SECTIONS"} 2>&1 \
  | tee "$OUT/gpu_check.log"
RC=${PIPESTATUS[0]}
echo "[gpu_check] done in $(($(date +%s) - T0)) s (exit $RC)" | tee -a "$OUT/gpu_check.log"
if [ "${GPU_CHECK_MORE:-0}" = 1 ] && [ "$REHEARSE" = 0 ]; then
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${NGPU:-0}" -gt 1 ]; then
  timeout 120 "$PY" launch/lp_run.py parallel.workers="$NGPU" parallel.backend=nccl decoding.W=15 decoding.N=5 \
    decoding.G=15 decoding.max_new_tokens=128 stream=false output="$OUT/lp_nccl.json" > "$OUT/lp_nccl.log" 2>&1 \
    || echo "LP over NCCL failed (see lp_nccl.log)" >> "$OUT/gpu_check.log"
  # the mesh: LP x TP over NCCL
  if [ $((NGPU % 3)) -eq 0 ]; then TP=3; MODEL_ARGS=(); else TP=2; MODEL_ARGS=(model.path="$OUT/tiny_tp"); fi
  if [ "$TP" = 2 ]; then
    "$PY" -c "
import shutil, sys; from pathlib import Path
from tests.helpers import make_tiny_model; from lp.model.loader import resolve_model_path
out = Path(sys.argv[1]); make_tiny_model(vocab=49152).save_pretrained(out)
src = resolve_model_path('smollm2', None)
[shutil.copy(src / f, out / f) for f in ('tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja') if (src / f).exists()]
" "$OUT/tiny_tp" >> "$OUT/lp_mesh.log" 2>&1
  fi
  timeout 150 "$PY" launch/lp_run.py parallel.workers=$((NGPU / TP)) parallel.tp=$TP parallel.backend=nccl \
    "${MODEL_ARGS[@]}" decoding.W=15 decoding.N=5 decoding.G=15 decoding.max_new_tokens=64 stream=false \
    output="$OUT/lp_mesh.json" >> "$OUT/lp_mesh.log" 2>&1 \
    && timeout 120 "$PY" -c "
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
timeout 120 "$PY" -c "
import json, sys, torch; from lp.model.loader import resolve_dtype, resolve_model_path; from lp.parallel.memory import plan_memory
from lp.parallel.tp import load_for
path = resolve_model_path('smollm2', None); dev = torch.device('cuda')
plan = plan_memory(path, resolve_dtype('bfloat16', dev), dev, 1, max_len=4096, step_rows=64)
m, _ = load_for(path, 'bfloat16', 'cuda', 'none', None, tokenizer=False)
print('memory plan weights', plan.weights / 2**20, 'MB; allocated after load', torch.cuda.memory_allocated() / 2**20, 'MB;',
      'dtypes', sorted({str(p.dtype) for p in m.parameters()}))
" >> "$OUT/gpu_check.log" 2>&1 || echo "memory plan check failed" >> "$OUT/gpu_check.log"
if [ "${NGPU:-0}" -gt 1 ]; then
  timeout 240 "$PY" -m bench.tp_memory --device cuda --dtype bfloat16 --tps "1,$NGPU" --rounds 1 --ckpt /tmp/ckpt_480m \
    --out "$OUT/tp_memory" > "$OUT/tp_memory.log" 2>&1 || echo "sharded load over NCCL failed (see tp_memory.log)" >> "$OUT/gpu_check.log"
fi
timeout 240 "$PY" -m bench.gpu_quant --out "$OUT/gpu" > "$OUT/gpu_quant.log" 2>&1 \
  || echo "int4 section failed or timed out (see gpu_quant.log)" >> "$OUT/gpu_check.log"
fi
exit $RC
