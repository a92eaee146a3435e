"""Engine-free stand-ins shared by unit tests: a tokenizer with a chat template and a scripted
Backend. Both are deterministic, so tests can count tokens and predict every delta.

FakeTokenizer: one token per whitespace-separated word; ids are a stable hash of the word in
[FIRST_WORD_ID, vocab_size), so every id it produces is inside its vocabulary.

FakeBackend: `generate(request)` yields one GenerationDelta per scripted token; it can fail
before the first delta or after N deltas, and records what it saw:

    requests  every GenerationRequest received, in order
    outcomes  request_id -> "finished" | "closed" (consumer called aclose early) | "raised"
"""
from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.types import GenerationDelta, GenerationRequest

EOS_ID = 0
FIRST_WORD_ID = 3  # 0..2 are reserved for special tokens


class FakeTokenizer:
    """The slice of a Hugging Face tokenizer that PromptRenderer uses."""

    chat_template = "chatml-like (fake)"
    eos_token_id = EOS_ID

    def __init__(self, vocab_size: int = 1000):
        if vocab_size <= FIRST_WORD_ID:
            raise ValueError("vocab_size must leave room for word ids")
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def word_id(self, word: str) -> int:
        return FIRST_WORD_ID + zlib.crc32(word.encode()) % (self.vocab_size - FIRST_WORD_ID)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], tokenize: bool = False, add_generation_prompt: bool = True) -> str:
        if tokenize:
            raise NotImplementedError("the fake renders text only (PromptRenderer tokenizes itself)")
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return text

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        ids = [self.word_id(w) for w in text.split()]
        if add_special_tokens:
            ids = [1] + ids
        return {"input_ids": ids}


@dataclass
class FakeBackend:
    """A scripted engine implementing the frontend's Backend protocol.

    tokens         text of each delta, one token each; the last delta is `finished`
    finish_reason  reported on the last delta
    cached_tokens  prefix-cache hits reported on every delta
    replica        set on the first delta only (as an engine replica does)
    error          raised after `error_after` deltas (0 = before the first delta)
    delay_s        sleep before each delta (lets a test interleave with a consumer)
    """

    tokens: Sequence[str] = (" Hello", " world", "!")
    finish_reason: str = "stop"
    cached_tokens: int = 0
    replica: str | None = "replica-a"
    error: BaseException | None = None
    error_after: int = 0
    delay_s: float = 0.0
    requests: list[GenerationRequest] = field(default_factory=list)
    outcomes: dict[str, str] = field(default_factory=dict)

    @property
    def last(self) -> GenerationRequest:
        assert self.requests, "the backend received no request"
        return self.requests[-1]

    def closed_early(self, request_id: str | None = None) -> bool:
        rid = request_id if request_id is not None else self.last.request_id
        return self.outcomes.get(rid) == "closed"

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        self.requests.append(request)
        rid = request.request_id
        self.outcomes[rid] = "started"
        try:
            for i, text in enumerate(self.tokens):
                if self.error is not None and i == self.error_after:
                    self.outcomes[rid] = "raised"
                    raise self.error
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                last = i == len(self.tokens) - 1
                yield GenerationDelta(
                    text=text,
                    token_ids=(FIRST_WORD_ID + i,),
                    prompt_tokens=len(request.prompt_token_ids),
                    cached_tokens=self.cached_tokens,
                    finished=last,
                    finish_reason=self.finish_reason if last else None,
                    replica=self.replica if i == 0 else None,
                )
            if self.error is not None and self.error_after >= len(self.tokens):
                self.outcomes[rid] = "raised"
                raise self.error
            self.outcomes[rid] = "finished"
        except GeneratorExit:
            self.outcomes[rid] = "closed"
            raise
