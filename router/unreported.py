"""The turns the conversation directory sent to each replica that the replica's reports do not show
yet: load the directory adds to the last report when it places (router/directory_loads.py). Pure
state; the directory's clock is passed in.

Why keyed by conversation: a report used to clear every turn counted on its replica. But a turn
planned while the report was on its way (made on the replica before the turn arrived there: the
ingress -> replica hop, the replica's queue, a first turn's remote prefill before its decode
reaches the decoder) is not in it, so it was forgotten: after such a report the decoder looked as
idle as before the turns were sent to it, and the rest of a burst of new conversations followed
them (tests/unit/test_directory_load.py: a burst of 8 over two idle decoders, one of which
reports mid-burst, split 5 : 3 before and 4 : 4 now). Not measured end to end: how often a report
lands inside a burst depends on the hop's latency and the report period. The fleet simulator
(baton/sim) hands a turn to its engine at the instant it is planned, so there the change moves
`bench scale --quick`'s figures by about 1 % at most.

Rules, per replica:
- a turn with a session id (`add(..., session_id=...)`, the directory's own plans) is kept until a
  report of that replica lists the conversation (a decoder's report lists what it served since
  its previous one, or all it holds; it marks a turn served when the turn arrives), or until the
  replica's second report after the turn was planned: a turn that never arrived (its caller went
  away, the request failed) stops counting after one full report period;
- anything else (a turn without a session id, a prefill replica's share of a turn: its reports
  list no conversations, turns an ingress's pin cache planned and reported afterwards) counts
  until the replica's next report, as before.

Invariants (check_integrity): every replica's total is the sum of its keyed and other turns and
tokens, all >= 0, and a replica with nothing counted has no entry.
"""
from __future__ import annotations

from collections.abc import Mapping

from router.report import ReplicaReport


class UnreportedTurns:
    def __init__(self) -> None:
        self._other: dict[str, tuple[int, int]] = {}  # replica -> (turns, tokens) counted until its next report
        self._keyed: dict[str, dict[str, tuple[int, int, float]]] = {}  # replica -> session id -> (turns, tokens, planned at)
        self._totals: dict[str, tuple[int, int]] = {}  # replica -> (turns, prompt tokens): both of the above

    @property
    def totals(self) -> Mapping[str, tuple[int, int]]:
        """replica -> (turns, prompt tokens) sent since its reports (router/directory_loads.Unreported)."""
        return self._totals

    def of(self, replica_id: str) -> tuple[int, int]:
        return self._totals.get(replica_id, (0, 0))

    def add(self, replica_id: str, prompt_tokens: int, now: float, session_id: str | None = None) -> None:
        """One more turn sent to `replica_id`; keyed by its conversation when `session_id` is given."""
        if session_id is None:
            turns, tokens = self._other.get(replica_id, (0, 0))
            self._other[replica_id] = (turns + 1, tokens + prompt_tokens)
        else:
            entries = self._keyed.setdefault(replica_id, {})
            turns, tokens, _ = entries.get(session_id, (0, 0, now))
            entries[session_id] = (turns + 1, tokens + prompt_tokens, now)
        turns, tokens = self._totals.get(replica_id, (0, 0))
        self._totals[replica_id] = (turns + 1, tokens + prompt_tokens)

    def reported(self, report: ReplicaReport, previous_at: float | None) -> None:
        """A report of its replica arrived; `previous_at`: when its previous report arrived (None: none did)."""
        rid = report.replica_id
        self._other.pop(rid, None)
        entries = self._keyed.get(rid)
        if entries:
            listed = {sid for sid, _ in report.conversations}
            kept = {sid: e for sid, e in entries.items()
                    if sid not in listed and previous_at is not None and e[2] >= previous_at}
            if kept:
                self._keyed[rid] = kept
            else:
                del self._keyed[rid]
        self._total(rid)

    def _total(self, rid: str) -> None:
        turns, tokens = self._other.get(rid, (0, 0))
        for t, k, _ in self._keyed.get(rid, {}).values():
            turns, tokens = turns + t, tokens + k
        if turns or tokens:
            self._totals[rid] = (turns, tokens)
        else:
            self._totals.pop(rid, None)

    def check_integrity(self) -> None:
        for rid in set(self._other) | set(self._keyed) | set(self._totals):
            turns, tokens = self._other.get(rid, (0, 0))
            if turns < 0 or tokens < 0:
                raise AssertionError(f"negative unreported load on {rid}")
            for sid, (t, k, _) in self._keyed.get(rid, {}).items():
                if t < 1 or k < 0:
                    raise AssertionError(f"unreported turn of {sid} on {rid} counts {t} turns, {k} tokens")
                turns, tokens = turns + t, tokens + k
            if self._totals.get(rid, (0, 0)) != (turns, tokens) or (rid in self._totals and not (turns or tokens)):
                raise AssertionError(f"unreported total of {rid} {self._totals.get(rid)} is not its turns' sum {(turns, tokens)}")
            if rid in self._keyed and not self._keyed[rid]:
                raise AssertionError(f"an empty keyed entry kept for {rid}")
