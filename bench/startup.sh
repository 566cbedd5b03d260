#!/bin/bash
# Seconds from `python -m lp.serve` (defaults) starting to the first answer of a 16-token chat request.
#
# Contract: bash bench/startup.sh [LP_CACHE dir] [label] [port]
#   LP_CACHE dir: where lp keeps its converted GGUF, t(Q) curve and batched-step costs; an empty
#     folder measures a fresh start (the kernels come from `python -m lp.kernels.prebuild`, as
#     launch/install.sh builds them), the same folder again a restart. Default: lp's own (~/.cache/lp).
#   Prints "<label>: first answer after N s"; the server's log goes to /tmp/lp_startup_<label>.log.
# Polls the request every 0.5 s until it answers; stops the server after. docs/performance.md's
# start-up table was measured with it.
set -u
cache=${1:-$HOME/.cache/lp}
label=${2:-start}
port=${3:-9123}
export LP_CACHE=$cache
log=/tmp/lp_startup_$label.log
t0=$(date +%s.%N)
python -m lp.serve server.port=$port > "$log" 2>&1 &
pid=$!
until curl -s -m 60 "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model":"smollm2","messages":[{"role":"user","content":"Say hi."}],"max_tokens":16}' 2>/dev/null \
    | grep -q choices; do
  sleep 0.5
  if ! kill -0 $pid 2>/dev/null; then echo "$label: the server exited; its log: $log"; tail -5 "$log"; exit 1; fi
done
t1=$(date +%s.%N)
echo "$label: first answer after $(python -c "print(round($t1 - $t0, 1))") s"
kill $pid
wait $pid 2>/dev/null
exit 0
