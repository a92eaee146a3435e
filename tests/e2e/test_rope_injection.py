"""Exact KV injection on every RoPE family the segment connector re-rotates, on real engines
(vLLM CPU, in this process, one engine at a time): SmolLM2 (plain neox RoPE) and the tiny
random-weight models `make setup` provisions (baton/tools/tiny_rope.py): tiny-llama31 (llama3
scaling, original context 256), tiny-qwen2, tiny-gptj (interleaved pairing, partial rotary 32/64).

Per model:
- the worker's rotation is the loaded model's own rotary embedding (bound through apply_model,
  kv_transfer/segment_worker.py bind_model_rope), of the expected family;
- exact injection (KV captured from the same prompt, keys through fp32 pre-RoPE and back) of a
  prefix that crosses position 256 reproduces greedy tokens, logprobs within 0.1 nats (as
  tests/e2e/test_memory_injection.py measured on SmolLM2);
- layer-0 keys (they depend on the token alone) captured at p and moved to q > 256 equal the
  engine's keys computed at q within 2 bf16 ulps of the largest element.

Run: HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python -m pytest -q tests/e2e/test_rope_injection.py -p no:cacheprovider"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from baton.engine.types import GenerationRequest, SamplingSpec
from kv_transfer.rope import RopeSpec
from kv_transfer.segments import KVSegment
from tests.e2e.key_moves import assert_keys_moved_p_to_q_match

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / ".cache" / "models"

# model: (vLLM rotary module, pairing, rotary dim)
FAMILIES = {
    "SmolLM2-135M-Instruct": ("RotaryEmbedding", "neox", 64),
    "tiny-llama31": ("Llama3RotaryEmbedding", "neox", 64),
    "tiny-qwen2": ("RotaryEmbedding", "neox", 64),
    "tiny-gptj": ("RotaryEmbedding", "gptj", 32),
}
FILLER = ("The river bends past the old mill, where the farmers bring their grain each autumn and the children "
          "watch the wheel turn slowly in the cold water. ")
SPAN = "- Caroline adopted a grey cat named Pixel in March.\n"


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any, Any]]:
    name = request.param
    path = MODELS / name
    if not (path / "config.json").exists():
        pytest.fail(f"model not provisioned at {path}: run `make setup`")
    from transformers import AutoTokenizer

    from baton.bench.local_engine import local_engine

    r = local_engine(path, max_model_len=2048, kv_cache_gib=0.25, cpu_threads=2, max_num_seqs=8)
    try:
        yield name, r, AutoTokenizer.from_pretrained(str(path))
    finally:
        r.shutdown()


def _tokens(tok: Any, text: str) -> tuple[int, ...]:
    return tuple(tok(text, add_special_tokens=False).input_ids)


def _worker_rope() -> RopeSpec:
    """The rotation the engine's segment worker applies (the engine runs in this process)."""
    from kv_transfer.segment_worker import process_segment_worker

    worker = process_segment_worker()
    assert worker is not None, "no segment connector in this process"
    assert worker.rope is not None, "the segment worker has no rope: injection is off"
    return worker.rope


def _run(runner: Any, ids: tuple[int, ...], injection: tuple[KVSegment, ...] | None = None,
         max_tokens: int = 12) -> tuple[tuple[int, ...], list[float], int]:
    req = GenerationRequest(request_id=uuid.uuid4().hex, prompt_token_ids=ids,
                            sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0, logprobs=True),
                            cache_salt=uuid.uuid4().hex)

    async def go() -> tuple[tuple[int, ...], list[float], int]:
        toks: list[int] = []
        lps: list[float] = []
        cached = 0
        async for d in runner.generate(req, injection=injection):
            toks.extend(d.token_ids)
            lps.extend(d.logprobs)
            cached = max(cached, d.cached_tokens)
        return tuple(toks), lps, cached

    return asyncio.run(go())


def _capture(runner: Any, ids: tuple[int, ...], ranges: tuple[tuple[int, int], ...]) -> tuple[KVSegment, ...]:
    return asyncio.run(runner.capture(uuid.uuid4().hex, ids, ranges, cache_salt=uuid.uuid4().hex))


def test_the_workers_rotation_is_the_models_own(model: tuple[str, Any, Any]) -> None:
    name, _, _ = model
    module, style, rotary = FAMILIES[name]
    rope = _worker_rope()
    assert rope.source.split(" ")[0] == module
    assert (rope.style, rope.rotary_dim, rope.head_dim) == (style, rotary, 64)


def test_exact_injection_across_position_256_reproduces_greedy_output(model: tuple[str, Any, Any]) -> None:
    _, runner, tok = model
    prefix = _tokens(tok, FILLER * 12)[:320]
    ids = prefix + _tokens(tok, " Question: where does the river bend? Answer:")
    end = len(prefix)
    assert end > 256  # beyond tiny-llama31's original context: its llama3 scaling applies
    (seg,) = _capture(runner, ids, ((0, end),))
    plain, plain_lp, cached = _run(runner, ids)
    injected, injected_lp, cached_inj = _run(runner, ids, injection=(seg,))
    assert cached == 0 and cached_inj == end  # the engine computed only the suffix
    assert injected == plain
    assert max(abs(a - b) for a, b in zip(injected_lp, plain_lp, strict=True)) < 0.1


def test_layer0_keys_moved_from_p_to_q_match_keys_computed_at_q(model: tuple[str, Any, Any]) -> None:
    _, runner, tok = model
    span = _tokens(tok, SPAN)
    short = _tokens(tok, "Facts:\n") + span
    long_ = _tokens(tok, FILLER * 12)[:300] + span
    p, q = len(short) - len(span), len(long_) - len(span)
    assert p < 256 < q
    (at_p,) = _capture(runner, short, ((p, len(short)),))
    (at_q,) = _capture(runner, long_, ((q, len(long_)),))
    rope = _worker_rope()
    assert len(span) == at_p.keys[0].shape[0]
    assert_keys_moved_p_to_q_match(at_p.keys[0], at_q.keys[0], p, q, rope)
