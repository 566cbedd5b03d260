#!/bin/bash
# Seconds from `python -m lp.serve` (defaults) starting to the first answer of a 16-token chat request.
#
# Contract: bash bench/startup.sh [LP_CACHE dir] [label] [port] [GGUF file]
#   LP_CACHE dir: where lp keeps a GGUF file's metadata, t(Q) curve and batched-step costs; an empty
#     folder measures a fresh start (the kernels come from `python -m lp.kernels.prebuild`, as
#     launch/install.sh builds them), the same folder again a restart. Default: lp's own (~/.cache/lp).
#   GGUF file: the model (model.path=...; default lp's, SmolLM2-135M-Instruct's Q4_1 file), asked a
#     16-token raw completion (the default model: a 16-token chat answer).
#   Prints "<label>: first answer after N s, resident R MiB (peak P MiB)" (the server's VmRSS / VmHWM
#   after that answer); the server's log goes to /tmp/lp_startup_<label>.log.
# Polls the request every 0.5 s until it answers; stops the server after. docs/performance.md's
# start-up table was measured with it.
set -u
cache=${1:-$HOME/.cache/lp}
label=${2:-start}
port=${3:-9123}
file=${4:-}
model=smollm2
args=()
if [ -n "$file" ]; then model=$(basename "$file" .gguf); args=("model.path=$file"); fi
export LP_CACHE=$cache
log=/tmp/lp_startup_$label.log
t0=$(date +%s.%N)
python -m lp.serve server.port=$port "${args[@]}" > "$log" 2>&1 &
pid=$!
url=/v1/chat/completions
body='{"model":"'"$model"'","messages":[{"role":"user","content":"Say hi."}],"max_tokens":16}'
if [ -n "$file" ]; then  # a file may hold no chat template (Gemma-3-270M's parts): a raw completion
  url=/v1/completions
  body='{"model":"'"$model"'","prompt":"def fibonacci(n):","max_tokens":16}'
fi
until curl -s -m 60 "http://127.0.0.1:$port$url" -H 'Content-Type: application/json' -d "$body" 2>/dev/null \
    | grep -q choices; do
  sleep 0.5
  if ! kill -0 $pid 2>/dev/null; then echo "$label: the server exited; its log: $log"; tail -5 "$log"; exit 1; fi
done
t1=$(date +%s.%N)
rss=$(awk '/^VmRSS/ {print int($2 / 1024)}' /proc/$pid/status)
peak=$(awk '/^VmHWM/ {print int($2 / 1024)}' /proc/$pid/status)
echo "$label: first answer after $(python -c "print(round($t1 - $t0, 1))") s, resident $rss MiB (peak $peak MiB)"
kill $pid
wait $pid 2>/dev/null
exit 0
