"""The directory's pins by session id, with each decoder's pin count and held prompt tokens kept
up to date as pins change, so placing a turn reads them per decoder instead of counting every pin
(router/directory_loads.py). Counting every pin on every turn made a placement cost grow with the
conversations the directory holds: ~0.7 ms per turn at 1,000 pins on this machine, most of it
that loop.

A pin's `decoder` and `prompt_tokens` change only through `move` and `hold` (the sums follow);
its other fields (last_seen, turns, handoffs, adopted) are the caller's to set, with one rule:
a pin's last_seen never decreases (it is set to now, or to the later of it and a touch's time;
`put` may start a pin anew at any time).

The least recently seen pin (`oldest`, what a full directory evicts) comes from a heap of
(last_seen, session id) entries pushed by `put`; an entry older than its pin's last_seen (it was
seen since) is pushed again with the new time when it reaches the top, one of a removed pin is
dropped there. Scanning every pin for the oldest, as before, cost a full directory one pass per new
conversation (~4 ms at 20,000 pins, ~0.2 s at the default 1,000,000).

Invariants (check_integrity): the sums equal a recount over the pins, no decoder has a zero
entry, and every pin has a heap entry no later than its last_seen.
"""
from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterator, Mapping

from router.directory_types import Pin


class PinTable:
    def __init__(self) -> None:
        self._pins: dict[str, Pin] = {}
        self._count: Counter[str] = Counter()  # decoder -> pins on it
        self._held: Counter[str] = Counter()  # decoder -> Σ of its pins' prompt_tokens
        self._changed: set[str] = set()  # decoders whose sums changed since take_changed
        self._by_seen: list[tuple[float, str]] = []  # a heap of (last_seen, session id), with stale entries (module docstring)

    # ---- reading ----------------------------------------------------------------------------
    def get(self, session_id: str | None) -> Pin | None:
        return self._pins.get(session_id) if session_id else None

    def __getitem__(self, session_id: str) -> Pin:
        return self._pins[session_id]

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._pins

    def __iter__(self) -> Iterator[str]:
        return iter(self._pins)

    def items(self) -> Iterator[tuple[str, Pin]]:
        return iter(self._pins.items())

    def values(self) -> Iterator[Pin]:
        return iter(self._pins.values())

    def counts(self) -> Mapping[str, int]:
        """Pins per decoder (decoders with none are absent). A live view: do not modify."""
        return self._count

    def held(self) -> Mapping[str, int]:
        """Prompt tokens of the pins per decoder. A live view: do not modify."""
        return self._held

    def take_changed(self) -> set[str]:
        """The decoders whose pin count or held tokens changed since the last call (router/fleet.py's loads)."""
        changed, self._changed = self._changed, set()
        return changed

    # ---- changing ---------------------------------------------------------------------------
    def put(self, session_id: str, pin: Pin) -> None:
        """Add a pin, or replace the one of `session_id`."""
        if not session_id:
            raise ValueError("a pin needs a non-empty session id")
        self.pop(session_id)
        self._pins[session_id] = pin
        self._add(pin.decoder, 1, pin.prompt_tokens)
        heapq.heappush(self._by_seen, (pin.last_seen, session_id))
        if len(self._by_seen) > 2 * len(self._pins) + 1024:  # removed pins' entries piled up: rebuild, O(pins) once per that many
            self._by_seen = [(p.last_seen, sid) for sid, p in self._pins.items()]
            heapq.heapify(self._by_seen)

    def oldest(self) -> str:
        """The session id of the least recently seen pin (LookupError: no pins)."""
        heap = self._by_seen
        while heap:
            seen, sid = heap[0]
            pin = self._pins.get(sid)
            if pin is not None and pin.last_seen == seen:
                return sid
            if pin is None or pin.last_seen < seen:  # removed, or the entry of a pin since put anew: it has its own
                heapq.heappop(heap)
            else:  # seen since: its entry moves to its new time
                heapq.heapreplace(heap, (pin.last_seen, sid))
        raise LookupError("no pins")

    def pop(self, session_id: str) -> Pin | None:
        pin = self._pins.pop(session_id, None)
        if pin is not None:
            self._add(pin.decoder, -1, -pin.prompt_tokens)
        return pin

    def move(self, session_id: str, decoder: str) -> None:
        """The pin of `session_id` now points at `decoder`."""
        pin = self._pins[session_id]
        if pin.decoder != decoder:
            self._add(pin.decoder, -1, -pin.prompt_tokens)
            pin.decoder = decoder
            self._add(decoder, 1, pin.prompt_tokens)

    def hold(self, session_id: str, prompt_tokens: int) -> None:
        """The pin of `session_id` now holds `prompt_tokens` of context on its decoder."""
        pin = self._pins[session_id]
        self._changed.add(pin.decoder)
        self._held[pin.decoder] += prompt_tokens - pin.prompt_tokens
        pin.prompt_tokens = prompt_tokens
        if not self._held[pin.decoder]:
            del self._held[pin.decoder]

    def _add(self, decoder: str, pins: int, tokens: int) -> None:
        self._changed.add(decoder)
        self._count[decoder] += pins
        self._held[decoder] += tokens
        if not self._count[decoder]:
            del self._count[decoder]
        if not self._held[decoder]:
            del self._held[decoder]

    def check_integrity(self) -> None:
        count: Counter[str] = Counter()
        held: Counter[str] = Counter()
        for p in self._pins.values():
            count[p.decoder] += 1
            held[p.decoder] += p.prompt_tokens
        if count != self._count or held != self._held:
            raise AssertionError(f"pin sums drifted: {dict(self._count)} / {dict(self._held)} vs recount {dict(count)} / {dict(held)}")
        if any(v == 0 for v in (*self._count.values(), *self._held.values())):
            raise AssertionError("a zero entry in the pin sums")
        first: dict[str, float] = {}
        for seen, sid in self._by_seen:
            first[sid] = min(seen, first.get(sid, seen))
        late = [sid for sid, p in self._pins.items() if sid not in first or first[sid] > p.last_seen]
        if late:
            raise AssertionError(f"pins without a heap entry at or before their last_seen: {late[:5]}")
