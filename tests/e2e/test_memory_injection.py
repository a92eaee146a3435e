"""KV segment injection on a real engine (SmolLM2, vLLM CPU, in this process): the segment
connector captures position-free KV, injects it re-rotated, and the engine really uses it.

Tolerances stated here were measured on this machine: an exact injection (KV captured from the
same prompt, keys through fp32 pre-RoPE and back), and facts encoded each after all their
predecessors, reproduce greedy tokens with the sampled tokens' logprobs within 0.1 nats;
layer-0 keys moved from position p to q match keys computed at q within 2 bf16 ulps of the key's
magnitude (layer 0's keys depend on the token alone, so any difference is the rotation's)."""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from baton.engine.types import GenerationRequest, SamplingSpec
from kv_transfer.segment_stats import segment_stats
from kv_transfer.segments import KVSegment, process_segments
from memory_store.layout import RecalledFact, memory_prompt
from tests.e2e.key_moves import assert_keys_moved_p_to_q_match

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
FACTS = [
    "Caroline adopted a grey cat named Pixel in March.",
    "Caroline works as a night-shift nurse at the city hospital.",
    "Caroline's favourite food is spicy ramen from the corner shop.",
    "Caroline is training for the Berlin marathon in September.",
]


@pytest.fixture(scope="module")
def runner() -> Iterator[Any]:
    if not (MODEL_DIR / "config.json").exists():
        pytest.fail(f"model not provisioned at {MODEL_DIR}: run `make setup`")
    from baton.bench.local_engine import local_engine

    r = local_engine(MODEL_DIR, max_model_len=2048, kv_cache_gib=0.25, cpu_threads=2, max_num_seqs=8)
    yield r
    r.shutdown()


@pytest.fixture(scope="module")
def renderer() -> Any:
    from deployments.chat import PromptRenderer

    return PromptRenderer.from_path(str(MODEL_DIR))


LAST_LOGPROBS: list[float] = []  # the sampled tokens' logprobs of the last _run


def _run(runner: Any, ids: tuple[int, ...], injection: tuple[KVSegment, ...] | None = None, salt: str | None = None,
         max_tokens: int = 12) -> tuple[tuple[int, ...], int]:
    req = GenerationRequest(request_id=uuid.uuid4().hex, prompt_token_ids=ids,
                            sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0, logprobs=True),
                            cache_salt=salt or uuid.uuid4().hex)

    async def go() -> tuple[tuple[int, ...], int]:
        toks: list[int] = []
        cached = 0
        LAST_LOGPROBS.clear()
        async for d in runner.generate(req, injection=injection):
            toks.extend(d.token_ids)
            LAST_LOGPROBS.extend(d.logprobs)
            cached = max(cached, d.cached_tokens)
        return tuple(toks), cached

    return asyncio.run(go())


def _capture(runner: Any, ids: tuple[int, ...], ranges: tuple[tuple[int, int], ...]) -> tuple[KVSegment, ...]:
    return asyncio.run(runner.capture(uuid.uuid4().hex, ids, ranges, cache_salt=uuid.uuid4().hex))


def _prompt(renderer: Any, question: str, facts: list[RecalledFact], window: int) -> Any:
    return memory_prompt(renderer, [{"role": "user", "content": question}], facts, user="caroline", model="smollm2",
                         window=window, inject=True)


def _whole_context_facts() -> list[RecalledFact]:
    """Each fact's context = every fact before it: encoded with w ≥ its index, the KV is exactly
    what computing the whole prompt produces (same tokens at the same positions)."""
    ids = [f"{i:032x}" for i in range(len(FACTS))]
    return [RecalledFact(ids[i], FACTS[i], tuple(FACTS[:i]), tuple(ids[:i])) for i in range(len(FACTS))]


def _encode(runner: Any, p: Any) -> tuple[KVSegment, ...]:
    """Encode the anchor and each fact as the replica's resolver does (memory_store/resolver.py)."""
    from memory_store.resolver import SegmentResolver

    resolver = SegmentResolver(runner, store=None, local_capacity_bytes=256 << 20)
    return asyncio.run(resolver.resolve(p.token_ids, p.injection))


def test_exact_injection_reproduces_greedy_output(runner: Any, renderer: Any) -> None:
    p = _prompt(renderer, "Where does Caroline work?", _whole_context_facts(), window=8)
    end = p.injection.end
    (seg,) = _capture(runner, p.token_ids, ((0, end),))
    plain, cached = _run(runner, p.token_ids)
    plain_lp = list(LAST_LOGPROBS)
    injected, cached_inj = _run(runner, p.token_ids, injection=(seg,))
    assert cached == 0 and cached_inj == end  # the engine computed only the suffix
    assert injected == plain
    assert max(abs(a - b) for a, b in zip(LAST_LOGPROBS, plain_lp, strict=True)) < 0.1


def test_corrupted_segment_changes_the_output(runner: Any, renderer: Any) -> None:
    p = _prompt(renderer, "What is Caroline's cat called?", _whole_context_facts(), window=8)
    (seg,) = _capture(runner, p.token_ids, ((0, p.injection.end),))
    plain, _ = _run(runner, p.token_ids)
    g = torch.Generator().manual_seed(0)
    bad = KVSegment(seg.token_ids, seg.keys, torch.randn(seg.values.shape, generator=g).to(seg.values.dtype) * 4)
    corrupted, cached = _run(runner, p.token_ids, injection=(bad,))
    assert cached == p.injection.end
    assert corrupted != plain


def test_layer0_keys_moved_from_p_to_q_match_keys_computed_at_q(runner: Any, renderer: Any) -> None:
    span = tuple(renderer.text_tokens("- Caroline adopted a grey cat named Pixel in March.\n"))
    short = tuple(renderer.text_tokens("Facts:\n")) + span
    long_ = tuple(renderer.text_tokens("Here is a much longer preamble before the facts begin, to move them along:\n")) + span
    p, q = len(short) - len(span), len(long_) - len(span)
    assert q - p >= 10
    (at_p,) = _capture(runner, short, ((p, len(short)),))
    (at_q,) = _capture(runner, long_, ((q, len(long_)),))
    from kv_transfer.segment_worker import process_segment_worker

    worker = process_segment_worker()  # the engine runs in this process: its worker's own rotation
    assert worker is not None and worker.rope is not None
    rope = worker.rope
    assert len(span) == at_p.keys[0].shape[0]
    assert_keys_moved_p_to_q_match(at_p.keys[0], at_q.keys[0], p, q, rope)


def test_whole_context_encoding_matches_prompt_injection(runner: Any, renderer: Any) -> None:
    """Facts encoded one by one (anchor alone; each fact after its predecessors), then injected:
    the same greedy answer as computing the facts' text (prompt injection)."""
    p = _prompt(renderer, "What is Caroline training for?", _whole_context_facts(), window=8)
    segs = _encode(runner, p)
    assert len(segs) == 1 + len(FACTS) and sum(s.num_tokens for s in segs) == p.injection.end
    plain, _ = _run(runner, p.token_ids)
    plain_lp = list(LAST_LOGPROBS)
    injected, cached = _run(runner, p.token_ids, injection=segs, salt=p.cache_salt)
    assert cached == p.injection.end
    assert injected == plain
    # logits: the sampled tokens' logprobs agree within 0.1 nats (measured max 0.06: the keys pass
    # once through fp32 pre-RoPE form and are rounded back to bf16)
    assert len(LAST_LOGPROBS) == len(plain_lp) == len(plain)
    assert max(abs(a - b) for a, b in zip(LAST_LOGPROBS, plain_lp, strict=True)) < 0.1


def test_a_recompute_tail_loads_the_first_facts_and_computes_the_last(runner: Any, renderer: Any) -> None:
    """memory.recompute_tail_tokens: the engine loads only [0, end of the injected facts) and computes
    the last fact with the rest; with exact segments that is the prompt's own greedy answer."""
    whole = _prompt(renderer, "What is Caroline's favourite food?", _whole_context_facts(), window=8)
    p = memory_prompt(renderer, [{"role": "user", "content": "What is Caroline's favourite food?"}], _whole_context_facts(),
                      user="caroline", model="smollm2", window=8, inject=True, recompute_tail=1)
    assert p.token_ids == whole.token_ids and p.injected_facts == len(FACTS) - 1
    segs = _encode(runner, p)
    assert len(segs) == len(FACTS)  # the anchor and the first three facts: the last is not loaded
    plain, _ = _run(runner, p.token_ids)
    plain_lp = list(LAST_LOGPROBS)
    out, cached = _run(runner, p.token_ids, injection=segs, salt=p.cache_salt)
    assert cached == p.injection.end < whole.injection.end
    assert out == plain
    assert max(abs(a - b) for a, b in zip(LAST_LOGPROBS, plain_lp, strict=True)) < 0.1


def test_window_zero_encoding_runs_and_is_used(runner: Any, renderer: Any) -> None:
    facts = [RecalledFact(f"{i:032x}", t) for i, t in enumerate(FACTS)]
    p = _prompt(renderer, "What does Caroline eat?", facts, window=0)
    segs = _encode(runner, p)
    assert all(not f.context_ids for f in p.injection.facts)
    _, cached = _run(runner, p.token_ids, injection=segs, salt=p.cache_salt)
    assert cached == p.injection.end


def test_mismatched_segments_fall_back_to_recompute(runner: Any, renderer: Any) -> None:
    p = _prompt(renderer, "Where does Caroline work?", _whole_context_facts(), window=8)
    (seg,) = _capture(runner, p.token_ids, ((0, p.injection.end),))
    wrong = KVSegment(tuple(reversed(seg.token_ids)), seg.keys, seg.values)  # tokens differ from the prompt's
    before = segment_stats().unavailable
    plain, _ = _run(runner, p.token_ids)
    out, cached = _run(runner, p.token_ids, injection=(wrong,))
    assert out == plain and cached == 0
    assert segment_stats().unavailable == before + 1
    assert len(process_segments()) == 0  # nothing left behind in the hand-over table


def test_async_and_engine_thread_loads_give_the_same_output_next_to_a_running_stream(runner: Any, renderer: Any) -> None:
    """A load on the connector's loader thread (the request waits in vLLM's WAITING_FOR_REMOTE_KVS
    while the engine steps others; by default loads of 1024 tokens or more, here every load): the
    same greedy tokens and logprobs as a load on the engine thread, while a long decode stream keeps
    producing tokens on the engine. Both runs have a stream beside them, so their steps batch the
    same shapes (a batch of one and a batch of two differ in the last bits of CPU matmuls)."""
    from kv_transfer.segment_scheduler import segment_scheduler_of
    from kv_transfer.segment_worker import process_segment_worker

    side, worker = segment_scheduler_of(runner.scheduler), process_segment_worker()
    assert side is not None and worker is not None and side.async_min_tokens == 1024  # the product's default
    p = _prompt(renderer, "What is Caroline's favourite food?", _whole_context_facts(), window=8)
    segs = _encode(runner, p)

    async def injected_beside_a_stream() -> tuple[tuple[int, ...], list[float], int, int]:
        streamed = 0
        started, stop = asyncio.Event(), asyncio.Event()
        stream_req = GenerationRequest(request_id=uuid.uuid4().hex, prompt_token_ids=p.token_ids[:64],
                                       sampling=SamplingSpec(max_tokens=4000, temperature=0.0, ignore_eos=True),
                                       cache_salt=uuid.uuid4().hex)

        async def stream() -> None:
            nonlocal streamed
            async for d in runner.generate(stream_req):
                streamed += len(d.token_ids)
                if streamed >= 4:
                    started.set()
                if stop.is_set():
                    return

        task = asyncio.create_task(stream())
        await started.wait()
        at_submit = streamed
        req = GenerationRequest(request_id=uuid.uuid4().hex, prompt_token_ids=p.token_ids,
                                sampling=SamplingSpec(max_tokens=12, temperature=0.0, logprobs=True),
                                cache_salt=uuid.uuid4().hex)
        toks: list[int] = []
        lps: list[float] = []
        async for d in runner.generate(req, injection=segs):
            toks.extend(d.token_ids)
            lps.extend(d.logprobs)
        stop.set()
        await task
        return tuple(toks), lps, at_submit, streamed

    before = worker.loader.submitted if worker.loader is not None else 0
    side.async_min_tokens = 0  # this prompt's ~100 injected tokens load in the background too
    try:
        in_background, bg_lp, at_submit, streamed = asyncio.run(injected_beside_a_stream())
    finally:
        side.async_min_tokens = 1024
    assert worker.loader is not None and worker.loader.submitted == before + 1
    assert worker.counters.snapshot().background_loads >= 1
    assert streamed > at_submit  # the stream stepped while the injected request ran
    worker.loader.check_integrity()
    assert worker.loader.in_flight == 0
    waits = worker.layer_waits
    on_engine_thread, thread_lp, at_submit, streamed = asyncio.run(injected_beside_a_stream())  # under 1024 tokens: inline
    assert streamed > at_submit
    assert worker.layer_waits >= waits + 30  # SmolLM2's 30 attention layers each waited for their layer (eager engine)
    assert worker.loader.submitted == before + 1  # that one loaded on the engine thread
    assert in_background == on_engine_thread
    assert max(abs(a - b) for a, b in zip(bg_lp, thread_lp, strict=True)) < 1e-4
    assert len(process_segments()) == 0
