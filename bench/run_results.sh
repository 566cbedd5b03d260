#!/usr/bin/env bash
# The commands that produced bench/results/ on the development machine (2-core CPU, idle).
set -euo pipefail
cd "$(dirname "$0")/.."
# issue: exact lookahead decoding -- 20 HumanEval prompts, 256 new tokens, 2 threads
# (recorded with the former bench/lookahead_vs_ar.py; the same measurement now:)
python -m bench.run +preset=lookahead_vs_ar out_dir=bench/results/lookahead_vs_ar/fp32
# issue: Lookahead Parallelism -- one process vs 2 workers, same W/N/G, 1 thread per worker
python -m bench.run name=lp_vs_single 'prompts.sets=[humaneval]' prompts.num_prompts=10 \
  'methods=[ar,lookahead,lp]' 'workers=[1,2]' threads=1 reference_threads=0 sweep=none \
  lookahead=cpu lookahead.scale_with_workers=false scaling_check=false plots=false out_dir=bench/results/default/lp_vs_single
# issue: strong scaling -- humaneval + mt_bench, 10 prompts each, 128 new tokens
python -m bench.run name=default 'tp_engines=[manual]'
# bf16 on this CPU (no AMX: bf16 rows are not cheap here), fewer prompts
python -m bench.run +preset=lookahead_vs_ar dtype=bfloat16 prompts.num_prompts=5 out_dir=bench/results/lookahead_vs_ar/bf16
# issue 8: draft trees vs generate and prompt lookup (code + chat sets, 128 new tokens)
# (final: one set per run, pauses so that each starts on a quiet machine)
for s in humaneval classeval mt_bench gsm8k; do
  sleep 100
  python -m bench.run +preset=drafts "prompts.sets=[$s]" prompts.num_prompts=20 name=drafts2_$s out_dir=bench/results/drafts/$s
done
