"""The client-visible truth of a tick session, against what a naive server-side counter reports.

A tick is classified from the client's side only (`classify`), first match wins:

    missing   no reply ever arrived (replied_at is None)
    late      replied_at > deadline_at (a reply exactly at the deadline is on time)
    empty     arrived in time with no text (text_len == 0; an error reply arrives empty)
    on_time   otherwise

A miss is any of late, empty or missing. A **collapse** is a run of K or more consecutive missed
ticks of one session (K = `DEFAULT_CONSECUTIVE` = 3 unless given), consecutive in `seq` order;
its onset is the deadline of the first tick of the first such run (the earliest moment the client
could see it). The client records every tick it sent, missing ones included, once that tick's
deadline has passed; so a session's seqs are contiguous (`check_integrity`).

The engine-wide **collapse onset** (`collapse_onset`, what the cliff predictor is scored against)
reads the latency series of all sessions together: the deadline of the first of K consecutive
late-or-missing ticks in scheduled-send order.

The naive view is what a server-side counter reports: ticks it served without error, its error
count, and deadline misses only where its own timing (`server_s`, receive -> last token) exceeded
the tick budget (deadline_at - sent_at). Queueing before the replica, transport, ticks that never
reached it and empty replies are invisible to it: an unbounded session can collapse while its
naive error and miss counters stay at 0.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

DEFAULT_CONSECUTIVE = 3

TickClass = Literal["on_time", "late", "empty", "missing"]


@dataclass(frozen=True)
class TickOutcome:
    """One tick as the client saw it (and, optionally, as the server measured it)."""

    seq: int
    sent_at: float
    deadline_at: float
    replied_at: float | None  # None: no reply arrived
    text_len: int
    server_s: float | None = None  # the server's own receive -> last-token time; None: it never finished
    server_error: bool = False  # the server counted this tick as an error

    @property
    def latency_s(self) -> float | None:
        return None if self.replied_at is None else self.replied_at - self.sent_at


def classify(outcome: TickOutcome) -> TickClass:
    if outcome.replied_at is None:
        return "missing"
    if outcome.replied_at > outcome.deadline_at:
        return "late"
    if outcome.text_len == 0:
        return "empty"
    return "on_time"


def is_miss(outcome: TickOutcome) -> bool:
    return classify(outcome) != "on_time"


@dataclass(frozen=True)
class SessionTruth:
    session_id: str
    ticks: int
    on_time: int
    late: int
    empty: int
    missing: int
    misses: int  # late + empty + missing
    longest_miss_run: int
    collapsed: bool  # longest_miss_run >= consecutive
    collapse_onset: float | None  # deadline of the first tick of the first collapsing run
    p99_latency_s: float | None  # nearest-rank p99 of replied ticks (late ones included)


@dataclass(frozen=True)
class NaiveView:
    session_id: str
    ticks_served: int  # the server finished them without error
    errors: int
    deadline_misses: int  # only where server_s exceeded the tick budget


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


class SessionLedger:
    """Owns the outcomes of one session's ticks, keyed by seq (each seq recorded once)."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self._by_seq: dict[int, TickOutcome] = {}

    def record(self, outcome: TickOutcome) -> None:
        if outcome.seq in self._by_seq:
            raise ValueError(f"session {self.session_id}: tick {outcome.seq} recorded twice")
        if outcome.deadline_at < outcome.sent_at:
            raise ValueError(f"tick {outcome.seq}: deadline before send")
        self._by_seq[outcome.seq] = outcome

    def outcomes(self) -> list[TickOutcome]:
        return [self._by_seq[s] for s in sorted(self._by_seq)]

    def misses(self) -> int:
        return sum(1 for o in self._by_seq.values() if is_miss(o))

    def _runs(self) -> list[tuple[int, TickOutcome]]:
        """(length, first outcome) of every maximal run of consecutive misses, in seq order."""
        runs: list[tuple[int, TickOutcome]] = []
        length, first = 0, None
        for o in self.outcomes():
            if is_miss(o):
                length, first = length + 1, (first if first is not None else o)
            else:
                if first is not None:
                    runs.append((length, first))
                length, first = 0, None
        if first is not None:
            runs.append((length, first))
        return runs

    def longest_miss_run(self) -> int:
        return max((n for n, _ in self._runs()), default=0)

    def collapsed(self, consecutive: int = DEFAULT_CONSECUTIVE) -> bool:
        return self.longest_miss_run() >= consecutive

    def collapse_onset(self, consecutive: int = DEFAULT_CONSECUTIVE) -> float | None:
        """Deadline of the first tick of the first run of >= `consecutive` misses (None: no collapse)."""
        return next((first.deadline_at for n, first in self._runs() if n >= consecutive), None)

    def p99_latency_s(self) -> float | None:
        return _p99([o.latency_s for o in self._by_seq.values() if o.latency_s is not None])

    def truth(self, consecutive: int = DEFAULT_CONSECUTIVE) -> SessionTruth:
        if consecutive < 1:
            raise ValueError("consecutive must be >= 1")
        counts = {c: 0 for c in ("on_time", "late", "empty", "missing")}
        for o in self._by_seq.values():
            counts[classify(o)] += 1
        longest = self.longest_miss_run()
        return SessionTruth(
            self.session_id, len(self._by_seq), counts["on_time"], counts["late"], counts["empty"],
            counts["missing"], len(self._by_seq) - counts["on_time"], longest, longest >= consecutive,
            self.collapse_onset(consecutive), self.p99_latency_s())

    def naive_view(self) -> NaiveView:
        served = errors = misses = 0
        for o in self._by_seq.values():
            if o.server_error:
                errors += 1
            elif o.server_s is not None:
                served += 1
                if o.server_s > o.deadline_at - o.sent_at:
                    misses += 1
        return NaiveView(self.session_id, served, errors, misses)

    def check_integrity(self) -> None:
        seqs = sorted(self._by_seq)
        if seqs and seqs != list(range(seqs[0], seqs[0] + len(seqs))):
            raise AssertionError(f"session {self.session_id}: tick seqs not contiguous")
        if any(k != o.seq for k, o in self._by_seq.items()):
            raise AssertionError("ledger key differs from outcome seq")


# ---- across sessions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CollapseSummary:
    """Truth vs naive counters over a set of sessions."""

    sessions: int
    collapsed: int
    ticks: int
    true_misses: int
    naive_errors: int
    naive_deadline_misses: int
    earliest_collapse_onset: float | None


def collapsed_sessions(ledgers: Iterable[SessionLedger], consecutive: int = DEFAULT_CONSECUTIVE) -> int:
    return sum(1 for ledger in ledgers if ledger.collapsed(consecutive))


def summarize(ledgers: Iterable[SessionLedger], consecutive: int = DEFAULT_CONSECUTIVE) -> CollapseSummary:
    truths, naives = [], []
    for ledger in ledgers:
        truths.append(ledger.truth(consecutive))
        naives.append(ledger.naive_view())
    onsets = [t.collapse_onset for t in truths if t.collapse_onset is not None]
    return CollapseSummary(
        sessions=len(truths),
        collapsed=sum(t.collapsed for t in truths),
        ticks=sum(t.ticks for t in truths),
        true_misses=sum(t.misses for t in truths),
        naive_errors=sum(n.errors for n in naives),
        naive_deadline_misses=sum(n.deadline_misses for n in naives),
        earliest_collapse_onset=min(onsets, default=None),
    )


def collapse_onset(outcomes: Iterable[TickOutcome], consecutive: int = DEFAULT_CONSECUTIVE) -> float | None:
    """Collapse onset of a whole engine from its tick-latency series: every tick of every session,
    ordered by scheduled send (sent_at, then seq); a tick is late when its reply is missing or came
    after its deadline (lateness > 0; an empty but timely reply is not late). The onset is the
    deadline of the first tick of the first run of `consecutive` late ticks in that order — the
    moment the engine as a whole stopped keeping time. None: no such run."""
    if consecutive < 1:
        raise ValueError("consecutive must be >= 1")
    run, first = 0, None
    for o in sorted(outcomes, key=lambda o: (o.sent_at, o.seq)):
        if classify(o) in ("late", "missing"):
            run, first = run + 1, (first if first is not None else o)
            if run >= consecutive:
                return first.deadline_at
        else:
            run, first = 0, None
    return None
