"""Real-time sessions on a real engine (SmolLM2, vLLM CPU, in this process): bounded sessions
(sink + window KV re-injected every tick) against unbounded ones (whole history every tick)."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from baton.engine.realtime.manager import RealtimeSessions
from baton.engine.realtime.messages import RealtimeOpen, RealtimeTick

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
LINES = [
    "Caller: hi, I am calling about my internet connection, it keeps dropping.",
    "Caller: it started on monday after the storm, the router lights blink orange.",
    "Caller: I already restarted it twice and unplugged the cable for a minute.",
    "Caller: my account number is four four two nine, the plan is the fibre one.",
    "Caller: can you send a technician this week, mornings are better for me.",
    "Caller: thursday works, please call me before you come, thanks a lot.",
    "Caller: one more thing, will I get a refund for the days without service?",
    "Caller: great, and how long does the refund take to appear on my bill?",
]


@pytest.fixture(scope="module")
def runner() -> Iterator[Any]:
    if not (MODEL_DIR / "config.json").exists():
        pytest.fail(f"model not provisioned at {MODEL_DIR}: run `make setup`")
    from baton.bench.local_engine import local_engine

    r = local_engine(MODEL_DIR, max_model_len=4096, kv_cache_gib=0.25, cpu_threads=2, max_num_seqs=8)
    yield r
    r.shutdown()


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


def _session(runner: Any, tok: Any, mode: str, sink: int, window: int, lines: list[str], max_tokens: int = 8) -> list[Any]:
    sessions = RealtimeSessions(runner)
    preamble = tuple(tok("You are a support agent on a phone call. Answer briefly.\n", add_special_tokens=False)["input_ids"])
    sid = f"s-{mode}-{sink}-{window}"
    sessions.open(RealtimeOpen(sid, mode, preamble, sink, window, max_tokens))  # type: ignore[arg-type]

    async def go() -> list[Any]:
        out = []
        for i, line in enumerate(lines):
            ids = tuple(tok(line + "\n", add_special_tokens=False)["input_ids"])
            out.append(await sessions.tick(RealtimeTick(sid, i, ids)))
        return out

    results = asyncio.run(go())
    sessions._live[sid].state.check_integrity()
    return results


def test_bounded_with_room_for_everything_equals_unbounded(runner: Any, tok: Any) -> None:
    lines = LINES[:5]
    unbounded = _session(runner, tok, "unbounded", 0, 0, lines)
    bounded = _session(runner, tok, "bounded", 16, 2048, lines)
    assert all(r.error is None for r in unbounded + bounded)
    assert [r.token_ids for r in bounded] == [r.token_ids for r in unbounded]
    # bounded computed only each tick's new tokens after the first
    assert all(b.computed_tokens < b.prompt_tokens for b in bounded[1:])


def test_bounded_kv_is_constant_after_the_window_fills(runner: Any, tok: Any) -> None:
    lines = LINES * 2
    bounded = _session(runner, tok, "bounded", 16, 64, lines)
    unbounded = _session(runner, tok, "unbounded", 0, 0, lines)
    assert all(r.error is None for r in bounded + unbounded)
    # measured from the engine's block pool while each tick ran (one session on the engine)
    late = [r.kv_peak_tokens for r in bounded[3:]]
    assert max(late) - min(late) <= 128  # within one 128-token block
    assert max(r.prompt_tokens for r in bounded[3:]) <= 16 + 64 + 40
    grow = [r.kv_peak_tokens for r in unbounded]
    assert grow[-1] >= grow[2] + 256 and grow[-1] > max(late)
