"""Where recalled memory facts go in a chat prompt, as token ids (the ingress side of InferScale).

Layout (one prompt, both modes):

    [anchor: chat template up to and including the memory header][fact 1 line]…[fact n line][rest]
    |<------------- exact KV (computed once) ------------->|<-- position-free fact KV -->|<- computed ->|

With a recompute tail of R tokens (MemoryConfig.recompute_tail_tokens), the last facts, the fewest
whose lines hold at least R tokens, are computed by the engine instead of injected:

    [anchor][fact 1 … fact m: injected KV][fact m+1 … fact n: computed][rest: computed]

They then attend to the injected facts before them as in prompt mode (a suffix form of CacheBlend's
selective recompute: vLLM's connector can only supply a contiguous prefix). The cost is bounded by R
whatever k is. When the tail covers every fact nothing is injected: the request is in prompt mode.

The memories sit at the end of the system message: "<system text>\\n\\nWhat you remember about the
user:\\n- fact 1\\n- fact 2\\n…". Each part is tokenized on its own and the ids concatenated, so a
fact's tokens are the same wherever it is placed; that is what lets its KV be encoded once and
reused. Prompt injection (the baseline) sends exactly these token ids and computes all of them;
KV injection sends the same ids with a MemoryInjection that lets the engine load [0, end).
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from kv_transfer.injection import MemoryFact, MemoryInjection

MEMORY_HEADER = "\n\nWhat you remember about the user:\n"
DEFAULT_SYSTEM = "You are a helpful assistant."
RESERVED_MARK = "\u0000baton-memory-block\u0000"  # where the facts go; refused in content
_MARK = RESERVED_MARK


class Renderer(Protocol):
    def chat_text(self, messages: list[dict[str, Any]]) -> str: ...

    def text_tokens(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class RecalledFact:
    """A fact the memory store returned for a request, with the texts of its w predecessors."""

    fact_id: str
    text: str
    context: tuple[str, ...] = ()
    context_fact_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class MemoryPrompt:
    token_ids: tuple[int, ...]
    injection: MemoryInjection | None  # None in prompt mode or without facts
    cache_salt: str | None
    fact_ids: tuple[str, ...] = ()  # the recalled facts, in prompt order (what the client is told)
    injected_facts: int = 0  # how many of them, from the first, come as KV (the rest are computed)

    @property
    def mode(self) -> Literal["kv", "prompt"]:
        """How the facts reach the engine: "kv" when their KV is injected, else "prompt" (prompt
        mode, or no fact recalled: nothing to inject)."""
        return "kv" if self.injection is not None else "prompt"


def fact_line(text: str) -> str:
    return "- " + " ".join(text.split()) + "\n"


class LineTokens:
    """The token ids of fact lines, remembered (an LRU of `capacity` texts) for one tokenizer.

    A fact's line tokenizes the same every time it is recalled, and a request tokenizes k(1 + w)
    lines (its facts and their contexts): at k = 50, w = 2 that took 19 ms of a 22 ms layout (3 ms
    at k = 5), the layout's only part that grows with k. Thread-safe: layouts run in worker threads.
    (No __len__: an empty cache must not be falsy where it is passed as an option.)"""

    def __init__(self, renderer: Renderer, capacity: int = 16384):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._renderer, self._capacity = renderer, capacity
        self._lines: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def __call__(self, text: str) -> tuple[int, ...]:
        with self._lock:
            ids = self._lines.get(text)
            if ids is not None:
                self._lines.move_to_end(text)
                self.hits += 1
                return ids
        ids = tuple(self._renderer.text_tokens(fact_line(text)))  # outside the lock: tokenizing is the slow part
        with self._lock:
            self.misses += 1
            self._lines[text] = ids
            self._lines.move_to_end(text)
            while len(self._lines) > self._capacity:
                self._lines.popitem(last=False)
        return ids

    @property
    def size(self) -> int:
        return len(self._lines)


def memory_prompt(
    renderer: Renderer,
    messages: Sequence[dict[str, Any]],
    facts: Sequence[RecalledFact],
    *,
    user: str,
    model: str,
    window: int,
    inject: bool,
    deletions: tuple[str, int] = ("", 0),
    recompute_tail: int = 0,
    line_tokens: Callable[[str], Sequence[int]] | None = None,
) -> MemoryPrompt:
    """Token ids of `messages` (template dicts: role, content) with `facts` in the system message.

    inject=True returns the MemoryInjection (and a cache salt naming this composition: vLLM
    registers the injected blocks in its prefix cache, and an approximate injection must never be
    hit by a request that did not ask for exactly it). `deletions`: the recall's deletion mark,
    carried to the engine replica on the injection. `recompute_tail`: at least this many tokens at
    the end of the memory block are computed instead of injected (whole facts; see the module doc).
    `line_tokens`: a fact text's line as token ids (a LineTokens of the same tokenizer), else
    tokenized here."""
    if recompute_tail < 0:
        raise ValueError("recompute_tail must be >= 0")
    msgs = list(messages)
    if msgs and msgs[0].get("role") == "system":
        system, rest = str(msgs[0].get("content") or ""), msgs[1:]
    else:
        system, rest = DEFAULT_SYSTEM, msgs
    if any(_MARK in str(m.get("content") or "") for m in msgs):
        raise ValueError("message content contains a reserved control sequence")
    text = renderer.chat_text([{"role": "system", "content": system + MEMORY_HEADER + _MARK}, *rest])
    before, after = text.split(_MARK, 1)
    anchor = renderer.text_tokens(before)
    tokens = (lambda text: renderer.text_tokens(fact_line(text))) if line_tokens is None else line_tokens
    ids, placed = list(anchor), []
    for f in facts:
        line = tuple(tokens(f.text))
        ctx_texts = f.context[-window:] if window else ()
        ctx = tuple(t for c in ctx_texts for t in tokens(c))
        ctx_ids = f.context_fact_ids[-window:] if window else ()
        placed.append(MemoryFact(fact_id=f.fact_id, start=len(ids), token_ids=line, context_ids=ctx, context_fact_ids=ctx_ids))
        ids.extend(line)
    ids.extend(renderer.text_tokens(after))
    fact_ids = tuple(f.fact_id for f in facts)
    injected = injected_prefix(placed, recompute_tail)
    if not inject or not injected:
        return MemoryPrompt(tuple(ids), None, None, fact_ids)
    injection = MemoryInjection(user=user, anchor_len=len(anchor), facts=injected, window=window, model=model,
                                deletions=deletions)
    injection.check_integrity(len(ids))
    return MemoryPrompt(tuple(ids), injection, composition_salt(injection, anchor), fact_ids, len(injected))


def injected_prefix(placed: Sequence[MemoryFact], recompute_tail: int) -> tuple[MemoryFact, ...]:
    """Pure: the facts injected as KV when the fewest last facts holding >= `recompute_tail` tokens
    are computed instead (all of them at 0; none when the tail covers every fact)."""
    n, tail = len(placed), 0
    while n and tail < recompute_tail:
        n -= 1
        tail += len(placed[n].token_ids)
    return tuple(placed[:n])


def composition_salt(injection: MemoryInjection, anchor: Sequence[int]) -> str:
    h = hashlib.sha256()
    h.update(f"{injection.user}\x00{injection.model}\x00{injection.window}\x00".encode())
    h.update(token_hash(anchor).encode())
    for f in injection.facts:
        # a fact's KV depends on the context it was encoded after: when that changes (a
        # predecessor deleted or added), blocks built from the old encoding must not be hit
        h.update(f"{f.fact_id}\x00{','.join(f.context_fact_ids)}\x00{token_hash(f.context_ids)}\x00".encode())
    return "baton-mem-" + h.hexdigest()[:32]


def encode_salt(user: str) -> str:
    """The cache salt of a user's memory encode captures (memory_store/resolver.py): their prompts
    hold the user's facts, so what they leave in the prefix cache is hit by that user's captures
    only, whatever isolation.prefix_cache says. A hash: the user id is not in it."""
    return "baton-mem-enc-" + hashlib.sha256(f"baton-mem-enc\x00{user}".encode()).hexdigest()[:32]


def token_hash(ids: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:32]
