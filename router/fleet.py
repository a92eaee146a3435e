"""The engine replicas as the conversation directory sees them: each one's latest report, the
replicas that failed a request, the turns sent to each since its report, and two views derived
from them that every turn reads — the live replicas of a pool, and each decoder's load — kept
between the changes that alter them instead of rebuilt per turn.

Why cached: a turn read every live decoder's report and built every decoder's load, so a routing
decision cost time in proportion to the fleet (~280 µs at 128 decoders, `baton bench directory`)
even for a pinned turn that needs none of it. Now the live list is rebuilt only when a report or
a failure arrives or the oldest report goes stale, and a decoder's load only when its report,
its unreported turns or its pins (router/pin_table.py's `changed`) change.

Invariants (check_integrity): unreported load is never negative and only on replicas that
reported; every cached load equals the load computed afresh; a cached live list equals the live
replicas at any time it is served for.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

from router.directory_loads import decoder_loads
from router.directory_types import Reported
from router.pin_table import PinTable
from router.report import ReplicaReport
from router.scoring import ReplicaLoad
from router.unreported import UnreportedTurns


class Fleet:
    def __init__(self, stale_after_s: float, pins: PinTable | None):
        """`pins`: the pins whose counts and held tokens count as decoder load (None: per-turn policies, no pin load)."""
        self.stale_after_s = stale_after_s
        self._pins = pins
        self.replicas: dict[str, Reported] = {}
        self.failed: dict[str, float] = {}  # replica -> when it failed
        self._unreported = UnreportedTurns()  # the turns routed to each replica that its reports do not show yet
        self._live: dict[str, tuple[list[ReplicaReport], float, float]] = {}  # pool -> (live, computed at, valid until)
        self._loads: dict[str, ReplicaLoad] = {}  # decoder -> its load

    # ---- changes ------------------------------------------------------------------------------
    def store(self, report: ReplicaReport, now: float) -> bool:
        """Keep a replica's report; False (nothing kept) for one sent before its failure and delivered after it."""
        rid = report.replica_id
        failed_at = self.failed.get(rid)
        if failed_at is not None and now - failed_at <= self.stale_after_s:
            return False
        previous = self.replicas.get(rid)
        self.replicas[rid] = Reported(report, now)
        self.failed.pop(rid, None)
        self._unreported.reported(report, previous.at if previous is not None else None)
        self._live.clear()
        self._loads.pop(rid, None)
        return True

    def fail(self, replica_id: str, now: float) -> None:
        self.failed[replica_id] = now
        self._live.clear()

    def count(self, replica_id: str, prompt_tokens: int, now: float, session_id: str | None = None) -> None:
        """One more turn sent to `replica_id`, counted until its reports show it (router/unreported.py;
        `session_id`: the turn's conversation, which a decoder's report lists once the turn arrived).
        A replica never reported carries none."""
        if replica_id in self.replicas:
            self._unreported.add(replica_id, prompt_tokens, now, session_id)
            self._loads.pop(replica_id, None)

    # ---- views --------------------------------------------------------------------------------
    def is_live(self, r: Reported, now: float) -> bool:
        return r.report.replica_id not in self.failed and now - r.at <= self.stale_after_s

    def live(self, pool: str, now: float) -> list[ReplicaReport]:
        """The live replicas of `pool`. A shared list: do not modify."""
        cached = self._live.get(pool)
        if cached is not None and cached[1] <= now <= cached[2]:
            return cached[0]
        live = [r for r in self.replicas.values() if r.report.pool == pool and self.is_live(r, now)]
        reports = [r.report for r in live]
        self._live[pool] = (reports, now, min((r.at for r in live), default=math.inf) + self.stale_after_s)
        return reports

    @property
    def unreported(self) -> Mapping[str, tuple[int, int]]:
        """replica -> (turns, prompt tokens) routed to it that its reports do not show yet."""
        return self._unreported.totals

    def unreported_of(self, replica_id: str) -> tuple[int, int]:
        return self._unreported.of(replica_id)

    def decoder_loads(self, live: list[ReplicaReport]) -> list[ReplicaLoad]:
        """The loads of the decoders in `live` (router/directory_loads.decoder_loads, kept per decoder)."""
        if self._pins is not None:
            for d in self._pins.take_changed():
                self._loads.pop(d, None)
        out = []
        for r in live:
            load = self._loads.get(r.replica_id)
            if load is None:
                load = self._loads[r.replica_id] = self._load_of(self.replicas[r.replica_id].report)
            out.append(load)
        return out

    def _load_of(self, r: ReplicaReport) -> ReplicaLoad:
        if self._pins is None:
            return decoder_loads([r], self.unreported, {}, {})[0]
        return decoder_loads([r], self.unreported, self._pins.counts(), self._pins.held())[0]

    def check_integrity(self) -> None:
        self._unreported.check_integrity()
        if set(self.unreported) - set(self.replicas):
            raise AssertionError("unreported load on a replica that never reported")
        if self._pins is not None:
            for d in self._pins.take_changed():
                self._loads.pop(d, None)
        for rid, load in self._loads.items():
            if rid in self.replicas and load != self._load_of(self.replicas[rid].report):
                raise AssertionError(f"the cached load of {rid} drifted: {load} vs {self._load_of(self.replicas[rid].report)}")
        for pool, (live, at, until) in self._live.items():
            fresh = [r.report for r in self.replicas.values() if r.report.pool == pool and self.is_live(r, at)]
            if live != fresh or any(r.at + self.stale_after_s < until for r in self.replicas.values() if r.report in live):
                raise AssertionError(f"the cached live {pool} replicas drifted")
