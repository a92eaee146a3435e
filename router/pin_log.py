"""The conversation directory's log of pin changes, for the ingresses' pin caches
(router/pin_cache.py): every change of a pin (a turn placed, moved, ended, expired, evicted,
adopted, or recorded from an ingress's cache) gets the next seq, with who made it (`via`: an
ingress's cache; None: the directory itself). An ingress that synced at seq s is answered the
conversations changed after s by anyone else, or `reset` when it knew another incarnation of the
directory or the log no longer reaches back to s (then it drops everything it cached).

Invariants (check_integrity): seqs strictly increase and the last one is the current seq."""
from __future__ import annotations

import uuid
from collections import deque

from router.directory_types import Pin
from router.pin_cache import Touch

CHANGE_LOG = 100_000  # changes kept; an ingress further behind resets its cache


class PinChangeLog:
    def __init__(self, capacity: int = CHANGE_LOG, incarnation: str | None = None):
        self.incarnation = incarnation or uuid.uuid4().hex  # a restarted directory is another one
        self.seq = 0
        self._changes: deque[tuple[int, str, str | None]] = deque(maxlen=capacity)  # (seq, session id, via)

    def changed(self, session_id: str, via: str | None = None) -> None:
        self.seq += 1
        self._changes.append((self.seq, session_id, via))

    def since(self, via: str, incarnation: str | None, after_seq: int) -> tuple[tuple[str, ...], bool]:
        """(session ids changed after `after_seq` by anyone but `via`, sorted; reset)."""
        reset = incarnation != self.incarnation or after_seq > self.seq or (bool(self._changes) and self._changes[0][0] > after_seq + 1)
        if reset:
            return (), True
        changed: set[str] = set()
        for seq, sid, by in reversed(self._changes):
            if seq <= after_seq:
                break
            if by != via:
                changed.add(sid)
        return tuple(sorted(changed)), False

    def check_integrity(self) -> None:
        seqs = [seq for seq, _, _ in self._changes]
        if any(b <= a for a, b in zip(seqs, seqs[1:], strict=False)) or (seqs and seqs[-1] != self.seq):
            raise AssertionError("the pin change log is out of order or behind the seq")


def record_touch(pin: Pin | None, t: Touch, now: float) -> bool:
    """A turn an ingress planned from its cache, recorded on its pin like a pinned turn the
    directory routed; False (nothing changed) when the pin moved, ended or is another user's
    meanwhile: that ingress learns it from the same sync."""
    if pin is None or pin.decoder != t.decoder or pin.user != t.user:
        return False
    pin.last_seen = max(pin.last_seen, now - t.age_s)
    pin.adopted = False  # its prompt tokens: the caller's PinTable.hold (they are summed per decoder)
    pin.turns += 1
    return True
