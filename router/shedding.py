"""Which live real-time sessions to shed when the AIMD cap falls under them (overload: shed), pure.

`choose_shed(live, cap)` answers with a `ShedPlan`: the sessions above the new cap, newest first
(the most recently admitted), so the sessions that have run longest keep their service. Ties in
admission time are broken by session id, the larger first, so the choice does not depend on the
order the sessions are listed in.

Invariants (checked on every plan: `ShedPlan.__post_init__` and `choose_shed`):
    count == max(0, live - cap)                    exactly the excess, none when live <= cap
    every shed session was admitted no earlier than every kept one (by (admitted_at, session_id))
    shed ids are distinct and in newest-first order
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SHED_CODE = "shed_overload"  # the error frame's code (and the gRPC status's baton-error code)


@dataclass(frozen=True)
class LiveSession:
    """A live session as the shed choice sees it: its id and when it was admitted (any clock)."""

    session_id: str
    admitted_at: float


@dataclass(frozen=True)
class ShedPlan:
    """The sessions to close so that `live - count == cap` (or nothing, when live <= cap)."""

    cap: int
    live: int
    shed: tuple[str, ...]  # newest first

    def __post_init__(self) -> None:
        if self.cap < 0 or self.live < 0:
            raise ValueError(f"cap and live must be >= 0, got {self.cap}, {self.live}")
        if len(self.shed) != max(0, self.live - self.cap):
            raise AssertionError(f"{len(self.shed)} sessions to shed, need max(0, {self.live} - {self.cap})")
        if len(set(self.shed)) != len(self.shed):
            raise AssertionError(f"a session is shed twice: {self.shed}")

    @property
    def count(self) -> int:
        return len(self.shed)


def _newest_first(s: LiveSession) -> tuple[float, str]:
    return (s.admitted_at, s.session_id)


def choose_shed(live: Sequence[LiveSession], cap: int) -> ShedPlan:
    """The sessions above `cap`, newest first (ties: the larger session id first)."""
    if cap < 0:
        raise ValueError(f"cap must be >= 0, got {cap}")
    ids = [s.session_id for s in live]
    if len(set(ids)) != len(ids):
        raise ValueError("live sessions must have distinct ids")
    ordered = sorted(live, key=_newest_first, reverse=True)
    # ordered: [ shed: the len(live) - cap newest | kept: the cap oldest ]
    excess = max(0, len(live) - cap)
    shed, kept = ordered[:excess], ordered[excess:]
    if shed and kept and _newest_first(shed[-1]) < _newest_first(kept[0]):
        raise AssertionError("a kept session is newer than a shed one")
    return ShedPlan(cap, len(live), tuple(s.session_id for s in shed))
