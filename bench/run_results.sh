#!/usr/bin/env bash
# The commands that produced bench/results/ on the development machine (2-core CPU, idle).
set -euo pipefail
cd "$(dirname "$0")/.."
# issue: exact lookahead decoding -- 20 HumanEval prompts, 256 new tokens, 2 threads
python -m bench.lookahead_vs_ar --dtype float32 --prompts 20 --max-new-tokens 256 --threads 2 \
  --configs paper default --out bench/results/lookahead_vs_ar_fp32
# issue: Lookahead Parallelism -- one process vs 2 workers, same W/N/G, 1 thread per worker
python -m bench.run name=lp_vs_single 'prompts.sets=[humaneval]' prompts.num_prompts=10 \
  'methods=[ar,lookahead,lp]' 'workers=[1,2]' threads=1 reference_threads=0 sweep=none \
  lookahead=cpu lookahead.scale_with_workers=false scaling_check=false plots=false
# issue: strong scaling -- humaneval + mt_bench, 10 prompts each, 128 new tokens
python -m bench.run name=default 'tp_engines=[manual]'
# bf16 on this CPU (no AMX: bf16 rows are not cheap here), fewer prompts
python -m bench.lookahead_vs_ar --dtype bfloat16 --prompts 5 --max-new-tokens 256 --threads 2 \
  --configs default W5N4G5 --out bench/results/lookahead_vs_ar_bf16
