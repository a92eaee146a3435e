"""Incremental tokenization of a conversation's prompt: each turn's rendered text starts with the
previous turn's, so only what was appended is tokenized (the ingress otherwise re-tokenizes the
whole history on every turn: work, and time to first token, that grow with the conversation).

Exact by how tokenizers treat special tokens: the text is cut at every special token
(`<|im_start|>`, `<|eot_id|>`, ...) before anything else and each piece is tokenized on its own,
so tokens(a + b) == tokens(a) + tokens(b) whenever b starts with a special token. The cache keeps,
per conversation key, the rendered text up to its last special token and that text's token ids;
a turn whose text starts with it, a special token following, tokenizes only the rest. Any other
text (another history, an edited message, other tools) is tokenized whole, and its boundary
replaces the entry. `probe`
checks the rule on the model's own tokenizer and template at start: a tokenizer that breaks it
gets no cache (every prompt tokenized whole), never a wrong prompt.

A boundary is stored only when it can be matched in both: the last special token of the text is
the last special id of the ids, and as many special tokens precede it in each.

Bounded: at most `capacity` keys and `max_chars` characters of kept text in all, least recently
used out first. Thread-safe: prompts are rendered on a thread pool (deployments/offload.py).

Invariants (check_integrity): within both bounds; `chars` is the sum of the kept texts' lengths.
"""
from __future__ import annotations

import re
import threading
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

Tokenize = Callable[[str], list[int]]
DEFAULT_CAPACITY = 4096
DEFAULT_MAX_CHARS = 32 << 20  # characters of kept text in all: 32-128 MiB of text, plus 4 bytes per kept token id (~1 per 4 characters)
TOTALS = ("hits", "misses", "unmatched", "evicted")


@dataclass(frozen=True)
class _Kept:
    text: str  # the rendered text up to (not including) its last special token
    ids: array  # its token ids (int32: 4 bytes each)


class PrefixTokens:
    def __init__(self, tokenize: Tokenize, special: Mapping[str, int], *, capacity: int = DEFAULT_CAPACITY,
                 max_chars: int = DEFAULT_MAX_CHARS):
        """special: the tokenizer's special tokens (text -> id)."""
        if capacity < 1 or max_chars < 1:
            raise ValueError("capacity and max_chars must be >= 1")
        self._tokenize = tokenize
        self._special_ids = frozenset(special.values())
        self._by_id = {i: s for s, i in special.items()}
        # longest first: at one position the longest special token is the one the tokenizer cuts
        self._pattern = re.compile("|".join(re.escape(s) for s in sorted(special, key=len, reverse=True))) if special else None
        self._capacity, self._max_chars = capacity, max_chars
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.totals: Counter[str] = Counter()

    def tokens(self, key: str | None, text: str) -> list[int]:
        """The token ids of `text`, from the key's kept prefix when the text starts with it."""
        if key is None or self._pattern is None:
            return self._tokenize(text)
        with self._lock:
            kept = self._kept.get(key)
        # a cut only where this text too has a special token: what follows the kept part may have changed
        if kept is not None and text.startswith(kept.text) and self._pattern.match(text, len(kept.text)):
            ids = [*kept.ids, *self._tokenize(text[len(kept.text):])]
        else:
            kept, ids = None, self._tokenize(text)
        # only the new part is scanned: the kept part's special tokens were matched when it was kept
        cut = self._boundary(text, ids, len(kept.text) if kept else 0, len(kept.ids) if kept else 0)
        with self._lock:
            self.totals["hits" if kept is not None else "misses"] += 1
            old = self._kept.pop(key, None)
            if old is not None:
                self._chars -= len(old.text)
            if cut is None or cut[0] == 0:  # nothing to keep before the first special token
                self.totals["unmatched"] += cut is None
                return ids
            pos, n = cut
            self._kept[key] = _Kept(text[:pos], array("i", ids[:n]))
            self._chars += pos
            while len(self._kept) > self._capacity or self._chars > self._max_chars:
                _, gone = self._kept.popitem(last=False)
                self._chars -= len(gone.text)
                self.totals["evicted"] += 1
        return ids

    def _boundary(self, text: str, ids: list[int], from_char: int, from_id: int) -> tuple[int, int] | None:
        """(characters, ids) up to the last special token, matched in both from (from_char,
        from_id) on; None when they disagree there."""
        assert self._pattern is not None
        found = [(m.start(), m.group()) for m in self._pattern.finditer(text, from_char)]
        at = [j for j in range(from_id, len(ids)) if ids[j] in self._special_ids]
        if not found or len(found) != len(at) or self._by_id.get(ids[at[-1]]) != found[-1][1]:
            return None
        return found[-1][0], at[-1]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"keys": len(self._kept), "chars": self._chars, **{k: self.totals[k] for k in TOTALS}}

    def check_integrity(self) -> None:
        with self._lock:
            if len(self._kept) > self._capacity or self._chars > self._max_chars:
                raise AssertionError("kept prefixes over their bounds")
            if self._chars != sum(len(k.text) for k in self._kept.values()):
                raise AssertionError("chars disagrees with the kept texts")


def probe(tokenize: Tokenize, special: Mapping[str, int], turns: list[str]) -> bool:
    """Whether incremental tokenization reproduces whole tokenization on `turns` (successive
    renderings of one conversation, each extending the one before)."""
    cache = PrefixTokens(tokenize, special)
    return all(cache.tokens("probe", text) == tokenize(text) for text in turns) and cache.totals["hits"] == len(turns) - 1
