"""The directory's copy of the conversations each engine replica holds (ReplicaReport.conversations),
kept from complete lists and deltas. Pure state, clock passed in.

Why deltas: a decoder holds up to MAX_REPORTED_CONVERSATIONS conversations. Sending that whole
list in every report, to every directory shard, made each report cost the directory time in
proportion to it: unpickling the list, and one pass over it to adopt pins, hashing every session id
to its shard when there are several (`baton bench directory` times it). A delta lists only what
changed since the replica's previous report: the conversations it served, and those it dropped.

Protocol (deployments/directory_client.py sends, DirectoryState.report applies):
- a complete report replaces the replica's copy and makes it exact;
- a delta numbered `seq` applies on top of an exact copy whose last report was `seq - 1`;
- anything else (the first report a fresh directory hears from a replica is a delta; a report
  lost or overtaken in flight; a copy grown past the bound) leaves the copy inexact, and `apply`
  answers True: the replica then sends its complete list at once. The delta's own entries are
  still applied, so nothing it says is lost meanwhile.

Invariants (check_integrity): a copy holds at most MAX_REPORTED_CONVERSATIONS ids; an exact
replica has a copy and a last seq.
"""
from __future__ import annotations

from router.report import MAX_REPORTED_CONVERSATIONS, ReplicaReport


class HeldMirror:
    def __init__(self) -> None:
        self._held: dict[str, dict[str, float]] = {}  # replica -> session id -> when it was last served there
        self._seq: dict[str, int] = {}  # replica -> the seq of the last report applied
        self._exact: set[str] = set()  # replicas whose copy equals what they hold

    def apply(self, report: ReplicaReport, now: float) -> bool:
        """Apply one report; True when the replica should send its complete list."""
        rid = report.replica_id
        if report.conversations_complete:
            self._held[rid] = {sid: now - idle for sid, idle in report.conversations}
            self._seq[rid] = report.seq
            self._exact.add(rid)
            return False
        last = self._seq.get(rid)
        in_order = rid in self._exact and last is not None and report.seq == last + 1
        if last is not None and report.seq <= last and rid in self._exact:
            return False  # overtaken by a later report: what it says is already there or dropped since
        held = self._held.setdefault(rid, {})
        for sid in report.dropped:
            held.pop(sid, None)
        for sid, idle in report.conversations:
            held[sid] = now - idle
        self._seq[rid] = max(report.seq, last or 0)
        if len(held) > MAX_REPORTED_CONVERSATIONS:  # drops were missed: keep the most recent until the complete list comes
            for sid in sorted(held, key=held.__getitem__)[: len(held) - MAX_REPORTED_CONVERSATIONS]:
                del held[sid]
            in_order = False
        if not in_order:
            self._exact.discard(rid)
        return not in_order

    def holds(self, replica_id: str, session_id: str) -> bool:
        return session_id in self._held.get(replica_id, ())

    def exact(self, replica_id: str) -> bool:
        return replica_id in self._exact

    def held_count(self, replica_id: str) -> int:
        return len(self._held.get(replica_id, ()))

    def check_integrity(self) -> None:
        for rid, held in self._held.items():
            if len(held) > MAX_REPORTED_CONVERSATIONS:
                raise AssertionError(f"the copy of {rid}'s conversations holds {len(held)} ids (at most {MAX_REPORTED_CONVERSATIONS})")
        for rid in self._exact:
            if rid not in self._held or rid not in self._seq:
                raise AssertionError(f"{rid} is marked exact without a copy and a seq")
