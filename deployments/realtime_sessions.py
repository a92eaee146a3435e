"""The live real-time sessions at one ingress: who holds an AIMD admission slot, and shedding them.

`SessionRegistry` owns the slots. A session takes one when admitted (`admit`) and gives it back
exactly once: when it ends (`release`) or, under `realtime.admission.overload: shed`, when the
controller's decrease sheds it (`shed`), whichever comes first — a shed session's later release
frees nothing. A shed session is told through its entry: `stop` is set and `notice` says why; its
tick loop (deployments/realtime_api.py) sees that at its next tick boundary (never mid-reply),
sends `notice.frame()` — the error frame `shed_overload` with the cap, the live count and
retry_after_s — and closes with 1013 "try again later".

Invariants (`check_integrity`): live == the entries still holding a slot (an entry holds one iff it
has no notice); `stop` is set iff a notice is there; shed_total counts every entry ever shed, so
it is at least the shed entries not yet released.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from router.shedding import SHED_CODE, LiveSession, ShedPlan


@dataclass(frozen=True)
class ShedNotice:
    """Why a session was shed: the cap it was cut to, the sessions live before the cut."""

    cap: int
    live_sessions: int
    retry_after_s: float

    def frame(self) -> dict[str, Any]:
        return {"type": "error", "code": SHED_CODE,
                "message": f"session shed under overload: the session cap fell to {self.cap} with {self.live_sessions} sessions "
                           f"live, and the newest sessions above it are closed; retry after {self.retry_after_s:g} s",
                "cap": self.cap, "live_sessions": self.live_sessions, "retry_after_s": self.retry_after_s}


class LiveEntry:
    """One admitted session, owned by the registry. `stop` is set when it is shed."""

    def __init__(self, session_id: str, admitted_at: float) -> None:
        self.session_id = session_id
        self.admitted_at = admitted_at
        self.stop = asyncio.Event()
        self.notice: ShedNotice | None = None

    @property
    def holds_slot(self) -> bool:
        return self.notice is None


class SessionRegistry:
    def __init__(self) -> None:
        self._entries: dict[str, LiveEntry] = {}
        self.shed_total = 0

    @property
    def live(self) -> int:
        """Sessions holding an admission slot (a shed session no longer does)."""
        return sum(e.holds_slot for e in self._entries.values())

    def admit(self, session_id: str, now: float) -> LiveEntry:
        if session_id in self._entries:
            raise ValueError(f"session {session_id} is already live")
        entry = self._entries[session_id] = LiveEntry(session_id, now)
        return entry

    def holding(self) -> list[LiveSession]:
        """The sessions holding a slot, as the shed choice (router/shedding.py) sees them."""
        return [LiveSession(e.session_id, e.admitted_at) for e in self._entries.values() if e.holds_slot]

    def shed(self, plan: ShedPlan, notice: ShedNotice) -> list[LiveEntry]:
        """Free the slots of the plan's sessions and tell each to close; the entries shed now."""
        out = []
        for sid in plan.shed:
            entry = self._entries.get(sid)
            if entry is None or not entry.holds_slot:
                continue  # ended (or shed) since the plan was made
            entry.notice = notice
            entry.stop.set()
            out.append(entry)
        self.shed_total += len(out)
        return out

    def release(self, session_id: str) -> bool:
        """The session ended: forget it. True iff this freed its slot (False: it was shed)."""
        entry = self._entries.pop(session_id)
        return entry.holds_slot

    def check_integrity(self) -> None:
        for e in self._entries.values():
            if (e.notice is not None) != e.stop.is_set():
                raise AssertionError(f"session {e.session_id}: notice and stop disagree")
        if self.shed_total < len(self._entries) - self.live:
            raise AssertionError("shed entries not counted in shed_total")
