"""The cost of prefix-cache isolation (issue 11): the bundled agentic trace
(baton/traces/samples/agentic_small.jsonl, BFCL tool-use conversations whose system prompts are
shared by several conversations) with its conversations spread over several users, replayed once
under `isolation.prefix_cache: tenant` and once under `shared`, one after the other in one run,
each on a fresh local cluster (conserve's layout: 1 prefill engine on core 0 and 1 decode engine
on core 1, conversation routing: first turns prefilled on the prefill engine and handed to the
decoder over NIXL).

Figures per scope: cached fraction (usage cached_tokens / prompt_tokens over every turn, and over
first turns only, where cross-user system-prompt reuse shows), TTFT p50/p95 (all turns and first
turns), TTFET p50, errors. Then two probes on the warm cluster, each a conversation's first turn
resent as a new conversation (max_tokens 1): by a user who never sent anything (the oracle of
issue 11: under `tenant` its cached_tokens must be 0) and by the conversation's own user (its own
KV is still hit under `tenant`)."""
from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from baton.paths import REPO_ROOT

TRACE = REPO_ROOT / "baton" / "traces" / "samples" / "agentic_small.jsonl"
SCOPES = ("tenant", "shared")


@dataclass(frozen=True)
class Workload:
    users: int  # conversation i belongs to user i % users
    max_turns: int | None  # turns replayed per conversation (None: all)
    max_tokens: int  # cap on each turn's completion budget
    concurrency: int


QUICK = Workload(users=3, max_turns=2, max_tokens=16, concurrency=3)
FULL = Workload(users=3, max_turns=None, max_tokens=48, concurrency=6)


def spread_over_users(convs: Sequence[Any], w: Workload) -> list[Any]:
    """Pure: the trace's conversations as `w` replays them: conversation i by user `tenant-{i % users}`,
    at most `max_turns` turns, each reply capped at `max_tokens`."""
    out = []
    for i, c in enumerate(convs):
        turns = c.turns[: w.max_turns] if w.max_turns else c.turns
        turns = [t.model_copy(update={"max_tokens": min(t.max_tokens, w.max_tokens)}) for t in turns]
        out.append(c.model_copy(update={"user": f"tenant-{i % w.users}", "turns": turns}))
    return out


def scope_figures(result: Any) -> dict[str, Any]:
    """Pure: the figures of one scope's replay (a baton.traces.records.ReplayResult)."""
    from baton.traces.report import percentile

    ok = [t for t in result.turns if t.ok]
    first = [t for t in ok if t.turn_index == 0]

    def cached_fraction(ts: list[Any]) -> float | None:
        prompt = sum(t.prompt_tokens or 0 for t in ts)
        return sum(t.cached_tokens or 0 for t in ts) / prompt if prompt else None

    def ttft(ts: list[Any], q: float) -> float | None:
        return percentile([t.ttft_s for t in ts if t.ttft_s is not None], q)

    return {
        "turns": len(result.turns), "errors": len(result.turns) - len(ok),
        "prompt_tokens": sum(t.prompt_tokens or 0 for t in ok), "cached_tokens": sum(t.cached_tokens or 0 for t in ok),
        "cached_fraction": cached_fraction(ok), "first_turn_cached_fraction": cached_fraction(first),
        "ttft_p50_s": ttft(ok, 50), "ttft_p95_s": ttft(ok, 95),
        "first_turn_ttft_p50_s": ttft(first, 50), "first_turn_ttft_p95_s": ttft(first, 95),
        "ttfet_p50_s": percentile([c.ttfet_s for c in result.conversations if c.ttfet_s is not None], 50),
        "duration_s": result.duration_s,
    }


def probe(url: str, conv: Any, user: str) -> dict[str, int]:
    """`conv`'s first turn resent by `user` as a new conversation; its usage."""
    import httpx

    messages = ([{"role": "system", "content": conv.system}] if conv.system else []) + [
        {"role": conv.turns[0].role, "content": conv.turns[0].content}]
    body = {"messages": messages, "max_tokens": 1, "temperature": 0, "user": user, "session_id": f"probe-{uuid.uuid4().hex}"}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    use = r.json()["usage"]
    return {"prompt_tokens": int(use["prompt_tokens"]), "cached_tokens": int((use.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)}


def scope_args(scope: str) -> dict[str, Any]:
    """The app's config for one scope: conserve's conversation layout, isolation set to `scope`."""
    from baton.bench.conserve import pool_args

    return {**pool_args("conversation"), "isolation": {"prefix_cache": scope}}


def run_scope(scope: str, convs: list[Any], w: Workload, out_dir: Path) -> dict[str, Any]:
    from baton.bench.cluster import LocalServeApp
    from baton.traces.replay import replay

    args = scope_args(scope)
    with LocalServeApp(args, resources={"prefill_slot": 1, "decode_slot": 2}, log_dir=out_dir / f"serve-{scope}") as app:
        result = asyncio.run(replay(convs, app.url, w.concurrency, progress=False))
        stranger = probe(app.url, convs[0], f"probe-{uuid.uuid4().hex[:8]}")
        owner = probe(app.url, convs[0], convs[0].user)
    row = {"scope": scope, "start_s": app.start_seconds, **scope_figures(result), "probe_new_user": stranger, "probe_same_user": owner}
    print(f"[salting] {scope:6s} cached {_f(row['cached_fraction'])} (first turns {_f(row['first_turn_cached_fraction'])})  "
          f"TTFT p50 {_f(row['ttft_p50_s'])} s p95 {_f(row['ttft_p95_s'])} s (first turns p50 {_f(row['first_turn_ttft_p50_s'])} s)  "
          f"TTFET p50 {_f(row['ttfet_p50_s'])} s  errors {row['errors']}  probe cached: new user {stranger['cached_tokens']}"
          f"/{stranger['prompt_tokens']}, same user {owner['cached_tokens']}/{owner['prompt_tokens']}")
    return row


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    from baton.traces.format import load_trace

    w = QUICK if quick else FULL
    convs = spread_over_users(load_trace(TRACE), w)
    requests = sum(len(c.turns) for c in convs)
    print(f"[salting] {len(convs)} conversations over {w.users} users, {requests} requests, concurrency {w.concurrency}, scopes {SCOPES}")
    out_dir.mkdir(parents=True, exist_ok=True)
    by = {s: run_scope(s, convs, w, out_dir) for s in SCOPES}
    t, s = by["tenant"], by["shared"]
    result = {
        "quick": quick, "workload": asdict(w), "trace": str(TRACE.relative_to(REPO_ROOT)), "conversations": len(convs),
        "requests": requests, "scopes": list(by.values()),
        "cached_fraction_tenant": t["cached_fraction"], "cached_fraction_shared": s["cached_fraction"],
        "cached_fraction_ratio_tenant_over_shared": _ratio(t["cached_fraction"], s["cached_fraction"]),
        "first_turn_cached_fraction_tenant": t["first_turn_cached_fraction"],
        "first_turn_cached_fraction_shared": s["first_turn_cached_fraction"],
        "ttft_p50_ratio_tenant_over_shared": _ratio(t["ttft_p50_s"], s["ttft_p50_s"]),
        "first_turn_ttft_p50_ratio_tenant_over_shared": _ratio(t["first_turn_ttft_p50_s"], s["first_turn_ttft_p50_s"]),
        "probe_cached_tokens_tenant": t["probe_new_user"]["cached_tokens"],
        "probe_cached_tokens_shared": s["probe_new_user"]["cached_tokens"],
    }
    (out_dir / "salting.json").write_text(json.dumps(result, indent=2))
    print(f"[salting] wrote {out_dir / 'salting.json'}")
    print(f"RESULT cached_fraction_tenant={_f(result['cached_fraction_tenant'])} cached_fraction_shared={_f(result['cached_fraction_shared'])} "
          f"cached_fraction_ratio={_f(result['cached_fraction_ratio_tenant_over_shared'])} "
          f"ttft_p50_ratio_tenant_over_shared={_f(result['ttft_p50_ratio_tenant_over_shared'])} "
          f"first_turn_ttft_p50_ratio={_f(result['first_turn_ttft_p50_ratio_tenant_over_shared'])} "
          f"probe_cached_tokens_tenant={result['probe_cached_tokens_tenant']} probe_cached_tokens_shared={result['probe_cached_tokens_shared']}")
    return result
