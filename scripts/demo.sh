#!/usr/bin/env bash
# The main job on the embedded local default: start a local Ray with the pools' resources,
# `serve run cluster_configs/local.yaml`, replay the bundled agentic trace, print the summary, stop.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
export RAY_AUTH_MODE=disabled          # local only; keep Ray's token auth on for real clusters
export RAY_ADDRESS=127.0.0.1:26379
CONFIG=${BATON_CONFIG:-cluster_configs/local.yaml}
TRACE=${BATON_TRACE:-baton/traces/samples/agentic_small.jsonl}
URL=${BATON_URL:-http://127.0.0.1:8000}
OUT=${BATON_OUT:-runs/demo}
LOG=$OUT/serve.log
mkdir -p "$OUT"

SERVE_PID=""
cleanup() {
  echo "[demo] stopping"
  if [ -n "$SERVE_PID" ] && kill -0 "$SERVE_PID" 2>/dev/null; then
    serve shutdown -y >/dev/null 2>&1 || true      # delete the application gracefully
    kill -INT "$SERVE_PID" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL "$SERVE_PID" 2>/dev/null || true
    wait "$SERVE_PID" 2>/dev/null || true
  fi
  ray stop --force >/dev/null 2>&1 || true
}
trap cleanup EXIT

echo "[demo] starting a local Ray head (2 CPUs, prefill_slot=1, decode_slot=2)"
ray stop --force >/dev/null 2>&1 || true
ray start --head --port 26379 --num-cpus 2 --resources '{"prefill_slot": 1, "decode_slot": 2}' \
  --include-dashboard=false --disable-usage-stats >/dev/null

echo "[demo] serve run $CONFIG (log: $LOG)"
T0=$(date +%s)
serve run "$CONFIG" >"$LOG" 2>&1 &
SERVE_PID=$!
for _ in $(seq 1 240); do
  if ! kill -0 "$SERVE_PID" 2>/dev/null; then echo "[demo] serve run exited; last log lines:"; tail -30 "$LOG"; exit 1; fi
  if curl -sf "$URL/health" 2>/dev/null | grep -q '"status":"ok"'; then break; fi
  sleep 2
done
curl -sf "$URL/health" | grep -q '"status":"ok"' || { echo "[demo] not healthy in time"; tail -30 "$LOG"; exit 1; }
echo "[demo] application healthy after $(( $(date +%s) - T0 )) s"

echo "[demo] replaying $TRACE"
python -m baton replay "$TRACE" --url "$URL" --concurrency 4 --out "$OUT"

echo "[demo] memories: store two facts for user 'demo', then ask with memories recalled as KV"
curl -sf -X DELETE "$URL/v1/memories?user=demo" >/dev/null
curl -sf -X POST "$URL/v1/memories" -H 'content-type: application/json' \
  -d '{"user": "demo", "facts": ["My dog is a beagle called Biscuit.", "I live in Porto and work as a baker."]}' >/dev/null
curl -sf "$URL/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"messages": [{"role": "user", "content": "What is my dog called?"}], "user": "demo",
       "memories": {"k": 2}, "max_tokens": 24, "temperature": 0}' \
  | python -c 'import json, sys; r = json.load(sys.stdin); u = r["usage"]
print("[demo] answer:", r["choices"][0]["message"]["content"].strip())
print("[demo] prompt tokens", u["prompt_tokens"], "of which injected or cached", u["prompt_tokens_details"]["cached_tokens"])'
