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

echo "[demo] memories: store two facts for user 'demo', then ask what one of them says (recalled as KV)"
curl -sf -X DELETE "$URL/v1/memories?user=demo" >/dev/null
curl -sf -X POST "$URL/v1/memories" -H 'content-type: application/json' \
  -d '{"user": "demo", "facts": ["My dog is called Biscuit.", "I live in Porto and work as a baker."]}' >/dev/null
# which facts were recalled (x-baton-memories), how many prompt tokens came as KV, the answer; a
# missing header or no recalled fact is a failure of Baton, the model's wording never is
python -c '
import json, sys, urllib.request
url, key = sys.argv[1], "Biscuit"

def call(path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.headers, json.load(r)

headers, r = call("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say the name of my dog."}],
                                            "user": "demo", "memories": {"k": 2}, "max_tokens": 8, "temperature": 0})
recalled = headers.get("x-baton-memories")
if recalled is None:
    sys.exit("[demo] FAILED: the chat reply has no x-baton-memories header")
ids = [i for i in recalled.split(",") if i]
if not ids:
    sys.exit("[demo] FAILED: no memories were recalled for user demo")
facts = [call(f"/v1/memories/{i}?user=demo")[1]["text"] for i in ids]
u, answer, mode = r["usage"], r["choices"][0]["message"]["content"].strip(), headers.get("x-baton-memory-mode")
print(f"[demo] recalled {len(ids)} facts ({mode} mode):")
for f in facts:
    print("[demo]   -", f)
print("[demo] prompt tokens", u["prompt_tokens"], "of which injected as KV (or cached)", u["prompt_tokens_details"]["cached_tokens"])
print("[demo] answer:", answer)
if key.lower() in answer.lower():
    print("[demo] the answer uses the recalled fact")
else:
    print("[demo] the model did not use it; the recalled facts were:", "; ".join(facts))
' "$URL"
