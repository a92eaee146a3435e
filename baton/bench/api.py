"""`baton bench api [--quick]`: the agentic API's paths through one `serve run` of
cluster_configs/local_grpc.yaml (local.yaml + gRPC + API keys), as users take them.

1. tool-call round trip (the official `openai` client, HTTP): a forced call (tool_choice naming a
   function) comes back as `tool_calls` with JSON arguments and finish_reason "tool_calls"; the
   streamed deltas reassemble to the same call (greedy); the tool's result sent back as a `tool`
   message in the same conversation gets an answer from the same decoder.
2. gRPC against HTTP on the same trace, in one run: the agentic sample trace replayed four times
   in the order http, grpc, grpc, http (ABBA: a drift of the machine over the run weighs on both
   protocols alike), each time under its own user (an API key bound to it) and its own
   conversation ids, so no replay reuses another's prefix cache (tenant salts). Per protocol:
   TTFT p50 and output tokens/s over its two replays' turns; ratios gRPC / HTTP.
3. a real-time session over the bidirectional `Realtime` stream: session.start, N inputs, every
   output in order, session.end, status OK.
4. BFCL in native function-calling mode: BFCL multi-turn entries with their docs as OpenAI
   `tools`, replayed over HTTP; the model's calls run against BFCL's own simulated tools and
   their results go back as `tool` messages (baton/traces/replay_native.py). Reported: errors
   (must be 0) and the share of the model's calls that were parseable (SmolLM2-135M is weak at
   this: the figure is what it is, not a goal).

RESULT: tool_call_roundtrip=ok|fail grpc_ttft_ratio_vs_http=<x> grpc_tokens_per_s_ratio=<x>
grpc_realtime=ok|fail errors=<n> bfcl_native_errors=<n> bfcl_native_parseable_share=<x>
(errors: failed turns over all ABBA replays; a failed turn is never dropped from the figures:
its protocol's error count is printed). The ratios pool every round's turns; each round's own
ratios are printed and kept in the JSON (`rounds`) as their spread (full mode: 3 rounds).
"""
from __future__ import annotations

import asyncio
import copy
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from baton.bench.cluster import LocalServeApp
from baton.paths import REPO_ROOT, SAMPLE_TRACES
from baton.traces.bfcl import BfclOptions, build_bfcl_trace
from baton.traces.format import load_trace
from baton.traces.replay import replay
from baton.traces.report import percentile, summarize

HTTP_PORT, GRPC_PORT, RAY_PORT = 28600, 28690, 26690
RESOURCES = {"prefill_slot": 1, "decode_slot": 2}
OPERATOR = "api-bench-operator"
ORDER = ("http", "grpc", "grpc", "http")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"],
                   "additionalProperties": False}}}


def user_key(i: int) -> str:
    return f"api-bench-user-{i}"


def bench_args() -> dict[str, Any]:
    """local_grpc.yaml's application args (API keys from BATON_API_KEYS), fresh durable state."""
    doc = yaml.safe_load((REPO_ROOT / "cluster_configs" / "local_grpc.yaml").read_text())
    args = copy.deepcopy(doc["applications"][0]["args"])
    state = Path(tempfile.mkdtemp(prefix="baton-api-bench-"))
    args["routing"] = {**args["routing"], "ownership_db_path": str(state / "conversations.sqlite3")}
    args["memory"] = {**args["memory"], "db_path": str(state / "memories.sqlite3")}
    return args


def grpc_servicers() -> list[str]:
    doc = yaml.safe_load((REPO_ROOT / "cluster_configs" / "local_grpc.yaml").read_text())
    return list(doc["grpc_options"]["grpc_servicer_functions"])


def tool_roundtrip(url: str, key: str) -> dict[str, Any]:
    """Check 1 (see the module docstring); every check named, each True or False."""
    import openai

    c = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)
    model = c.models.list().data[0].id
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    raw = c.chat.completions.with_raw_response.create(model=model, messages=ask, tools=[WEATHER], tool_choice=named, temperature=0,
                                                      max_tokens=48, extra_headers={"x-session-id": "api-bench-tools"})
    first = raw.parse().choices[0]
    calls = first.message.tool_calls or []
    checks: dict[str, Any] = {"finish_tool_calls": first.finish_reason == "tool_calls", "one_call": len(calls) == 1}
    args: Any = None
    if calls:
        try:
            args = json.loads(calls[0].function.arguments)
        except ValueError:
            args = None
    checks["json_arguments"] = isinstance(args, dict) and isinstance(args.get("city"), str)
    streamed: dict[int, dict[str, str]] = {}
    for chunk in c.chat.completions.create(model=model, messages=ask, tools=[WEATHER], tool_choice=named, temperature=0, max_tokens=48,
                                           stream=True, extra_headers={"x-session-id": "api-bench-tools-stream"}):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or ():
                got = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
                got["name"] += (tc.function.name or "") if tc.function else ""
                got["arguments"] += (tc.function.arguments or "") if tc.function else ""
    checks["stream_reassembles"] = bool(calls) and list(streamed) == [0] and streamed[0]["name"] == calls[0].function.name \
        and _json_or_none(streamed[0]["arguments"]) == args
    if calls:
        history = [*ask, {"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
                   {"role": "tool", "tool_call_id": calls[0].id, "content": json.dumps({"weather": "sunny, 18 C"})}]
        raw2 = c.chat.completions.with_raw_response.create(model=model, messages=history, tools=[WEATHER], temperature=0, max_tokens=16,
                                                           extra_headers={"x-session-id": "api-bench-tools"})
        second = raw2.parse().choices[0]
        checks["answer_after_result"] = second.finish_reason in ("stop", "length", "tool_calls")
        checks["same_decoder"] = raw2.headers.get("x-baton-replica") == raw.headers.get("x-baton-replica")
    else:
        checks["answer_after_result"] = checks["same_decoder"] = False
    checks["call"] = {"name": calls[0].function.name, "arguments": calls[0].function.arguments} if calls else None
    return checks


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def replays(url: str, grpc_target: str, rounds: int) -> list[dict[str, Any]]:
    """Check 2: the sample trace replayed in ORDER (x rounds), each under its own user and ids."""
    trace = load_trace(SAMPLE_TRACES / "agentic_small.jsonl")
    out = []
    for i, protocol in enumerate(ORDER * rounds):
        convs = [c.model_copy(update={"conversation_id": f"api{i}-{c.conversation_id}", "user": f"api-user-{i}"}) for c in trace]
        t0 = time.monotonic()
        result = asyncio.run(replay(convs, url if protocol == "http" else grpc_target, concurrency=2, api_key=user_key(i),
                                    protocol=protocol, progress=False))
        s = summarize(result)
        ok_turns = [t for t in result.turns if t.error is None]
        out.append({"replay": i, "protocol": protocol, "seconds": time.monotonic() - t0, "turns": s.turns, "errors": s.errors,
                    "ttft_p50_s": s.ttft_p50_s, "output_tokens_per_s": s.output_tokens_per_s,
                    "ttfts_s": [t.ttft_s for t in ok_turns if t.ttft_s is not None],
                    "completion_tokens": s.completion_tokens, "duration_s": result.duration_s})
        print(f"[api] replay {i} over {protocol}: {s.turns} turns, {s.errors} errors, TTFT p50 {s.ttft_p50_s}, "
              f"{s.output_tokens_per_s} tok/s", flush=True)
    return out


# BFCL base entries whose docs fit SmolLM2's context as tools (8.7k-19k characters of tools JSON)
BFCL_IDS = ("multi_turn_base_56", "multi_turn_base_100", "multi_turn_base_64", "multi_turn_base_107", "multi_turn_base_71",
            "multi_turn_base_115")


def bfcl_native(url: str, key: str, ids: tuple[str, ...]) -> dict[str, Any]:
    """Check 4 (see the module docstring)."""
    convs = build_bfcl_trace(BfclOptions(ids=ids, mode="native", max_user_turns=3, max_tokens=128))
    result = asyncio.run(replay(convs, url, concurrency=3, api_key=key, progress=False, max_tool_rounds=3))
    s = summarize(result)
    return {"conversations": len(convs), "turns": s.turns, "errors": s.errors, "tool_calls": s.tool_calls,
            "parseable": s.tool_calls_parseable, "ok": s.tool_calls_ok, "parseable_share": s.tool_calls_parseable_share,
            "ttft_p50_s": s.ttft_p50_s,
            "failures": [t.error for t in result.turns if t.error is not None][:5]}


def per_round(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The gRPC/HTTP ratios of each ABBA round on its own (its two replays per protocol): the
    spread of the headline ratios over the run's rounds."""
    out = []
    for r in range(len(rows) // len(ORDER)):
        proto = per_protocol(rows[r * len(ORDER):(r + 1) * len(ORDER)])
        h, g = proto["http"], proto["grpc"]
        out.append({"round": r, "ttft_ratio": _ratio(g["ttft_p50_s"], h["ttft_p50_s"]),
                    "tokens_per_s_ratio": _ratio(g["output_tokens_per_s"], h["output_tokens_per_s"])})
    return out


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a and b else float("nan")


def per_protocol(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """TTFT p50 over every successful turn of a protocol's replays; tokens/s = its completion
    tokens over its replays' wall time; errors summed (never dropped)."""
    out = {}
    for protocol in ("http", "grpc"):
        mine = [r for r in rows if r["protocol"] == protocol]
        ttfts = [t for r in mine for t in r["ttfts_s"]]
        seconds = sum(r["duration_s"] for r in mine)
        out[protocol] = {"replays": len(mine), "turns": sum(r["turns"] for r in mine), "errors": sum(r["errors"] for r in mine),
                         "ttft_p50_s": percentile(ttfts, 50.0) if ttfts else None,
                         "output_tokens_per_s": sum(r["completion_tokens"] for r in mine) / seconds if seconds > 0 else None}
    return out


async def realtime_session(target: str, key: str, inputs: int) -> dict[str, Any]:
    """Check 3 (see the module docstring)."""
    import grpc

    from deployments.grpc_gen import baton_pb2 as pb
    from deployments.grpc_gen import baton_pb2_grpc

    metadata = [("authorization", f"Bearer {key}"), ("application", "baton")]
    frames: list[dict[str, Any]] = []
    async with grpc.aio.insecure_channel(target) as ch:
        call = baton_pb2_grpc.BatonStub(ch).Realtime(metadata=metadata, timeout=300)
        await call.write(pb.RealtimeFrame(json=json.dumps({"type": "session.start", "instructions": "Reply briefly.", "max_tokens": 4,
                                                           "tick_ms": 5000, "deadline_ms": 60000})))
        frames.append(json.loads((await call.read()).json))
        for seq in range(inputs):
            await call.write(pb.RealtimeFrame(json=json.dumps({"type": "input", "seq": seq, "text": f"Say the number {seq}."})))
            frames.append(json.loads((await call.read()).json))
        await call.write(pb.RealtimeFrame(json=json.dumps({"type": "session.end"})))
        eof = await call.read() is grpc.aio.EOF
        code = await call.code()
    outputs = [f for f in frames[1:] if f.get("type") == "output"]
    ok = (frames[0].get("type") == "session.started" and [f.get("seq") for f in outputs] == list(range(inputs))
          and all(f.get("text") for f in outputs) and eof and code == grpc.StatusCode.OK)
    return {"ok": ok, "frames": [f.get("type") for f in frames], "status": code.name}


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rounds, inputs = (1, 4) if quick else (3, 12)
    keys = ",".join([OPERATOR, *(f"{user_key(i)}=api-user-{i}" for i in range(len(ORDER) * rounds))])  # replay i: user api-user-i
    app = LocalServeApp(bench_args(), resources=RESOURCES, http_port=HTTP_PORT, ray_port=RAY_PORT, env={"BATON_API_KEYS": keys},
                        grpc_options={"port": GRPC_PORT, "grpc_servicer_functions": grpc_servicers()}, log_dir=out_dir / "serve")
    target = f"127.0.0.1:{GRPC_PORT}"
    with app as running:
        print(f"[api] app healthy after {running.start_seconds:.0f}s", flush=True)
        tools = tool_roundtrip(running.url, OPERATOR)
        print(f"[api] tool round trip: {tools}", flush=True)
        rows = replays(running.url, target, rounds)
        realtime = asyncio.run(realtime_session(target, OPERATOR, inputs))
        print(f"[api] gRPC realtime: {realtime}", flush=True)
        bfcl = bfcl_native(running.url, OPERATOR, BFCL_IDS[:3] if quick else BFCL_IDS)
        print(f"[api] BFCL native: {bfcl}", flush=True)
    proto = per_protocol(rows)
    h, g = proto["http"], proto["grpc"]
    ttft_ratio = _ratio(g["ttft_p50_s"], h["ttft_p50_s"])
    tps_ratio = _ratio(g["output_tokens_per_s"], h["output_tokens_per_s"])
    rounds_ = per_round(rows)
    tools_ok = all(v for k, v in tools.items() if k != "call")
    errors = h["errors"] + g["errors"]
    report = {"quick": quick, "order": list(ORDER * rounds), "tool_roundtrip": tools, "replays": rows, "per_protocol": proto,
              "grpc_ttft_ratio_vs_http": ttft_ratio, "grpc_tokens_per_s_ratio": tps_ratio, "rounds": rounds_, "realtime": realtime,
              "bfcl_native": bfcl}
    (out_dir / "api.json").write_text(json.dumps(report, indent=2, default=str))
    _plot(rows, out_dir / "api.png")
    print(f"[api] HTTP: {h}; gRPC: {g}")
    print("[api] per ABBA round, gRPC/HTTP: " + "; ".join(f"round {r['round']}: TTFT p50 {r['ttft_ratio']:.3f}, tokens/s "
                                                         f"{r['tokens_per_s_ratio']:.3f}" for r in rounds_))
    print(f"RESULT tool_call_roundtrip={'ok' if tools_ok else 'fail'} grpc_ttft_ratio_vs_http={ttft_ratio:.3f} "
          f"grpc_tokens_per_s_ratio={tps_ratio:.3f} grpc_realtime={'ok' if realtime['ok'] else 'fail'} errors={errors} "
          f"bfcl_native_errors={bfcl['errors']} bfcl_native_parseable_share={_fmt(bfcl['parseable_share'])}")
    return report


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for r in rows:
        ax.scatter([r["replay"]] * len(r["ttfts_s"]), r["ttfts_s"], s=8, color="tab:blue" if r["protocol"] == "http" else "tab:orange")
    ax.set_xticks([r["replay"] for r in rows], [f"{r['replay']}: {r['protocol']}" for r in rows])
    ax.set_ylabel("TTFT (s)")
    ax.set_title("the agentic sample trace, replay by replay (ABBA)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(x: float | None) -> str:
    return "none" if x is None else f"{x:.3f}"
