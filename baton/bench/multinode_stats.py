"""Figures of `baton bench multinode`, pure: per kill cycle, from the turns the clients saw.

A turn is lost when it got no complete answer after one retry of a retryable failure (the
reliability bench's rule, reliability_client.with_one_retry). Recovery of a conversation that
was pinned to the killed node's decoder: from the kill to the end of its first ok turn that ran
on another decoder (+inf when it never got one: a figure that can fail, never dropped).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TurnRecord:
    """One turn as its client saw it; times in seconds from the cycle's start."""

    conversation: str
    started: float
    ended: float
    ok: bool
    lost: bool
    attempts: int
    replica: str | None  # the decoder that answered (None: no answer)
    pinned_before: str | None  # the decoder of the conversation's previous ok turn

    @property
    def seconds(self) -> float:
        return self.ended - self.started


@dataclass(frozen=True)
class CycleStats:
    cycle: int
    conversations: int
    on_worker: int  # conversations whose first turn was placed on the worker node's decoder
    cross_node_handoffs: int  # KV transfers the worker's decoder received for those first turns
    cross_node_bytes: int
    killed_at: float
    turns: int
    turns_after_kill: int  # turns that ended after the kill
    lost: int
    retried: int  # turns that needed their one retry
    p50_turn_s_before: float  # turn duration (with retries) of turns that ended before the kill
    max_turn_s_after: float  # the slowest turn that ended after the kill
    moved: int  # conversations pinned to the victim at the kill that answered on another decoder after it
    recovery_s: float  # the slowest of those: kill -> its first ok turn on another decoder (+inf: never)
    resumed_streams: int  # streams the ingress resumed on another decoder during the cycle
    leftover_processes: int  # processes of the killed node still alive after the wait
    rejoin_s: float  # the worker node restarted -> a decoder live on it again (+inf: never)


def _p50(values: Sequence[float]) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def cycle_stats(cycle: int, turns: Sequence[TurnRecord], killed_at: float, victim: str, *, conversations: int, on_worker: int,
                cross_node_handoffs: int, cross_node_bytes: int, resumed_streams: int, leftover_processes: int,
                rejoin_s: float) -> CycleStats:
    before = [t for t in turns if t.ended <= killed_at]
    after = [t for t in turns if t.ended > killed_at]
    # conversations on the victim at the kill: their last turn that ended before it ran there
    last: dict[str, TurnRecord] = {}
    for t in sorted(before, key=lambda t: t.ended):
        if t.ok:
            last[t.conversation] = t
    pinned = {c for c, t in last.items() if t.replica == victim}
    recovered: dict[str, float] = {}
    for t in sorted(after, key=lambda t: t.ended):
        if t.conversation in pinned and t.ok and t.replica not in (None, victim) and t.conversation not in recovered:
            recovered[t.conversation] = t.ended - killed_at
    recovery = max((recovered.get(c, math.inf) for c in pinned), default=math.nan)
    return CycleStats(
        cycle=cycle, conversations=conversations, on_worker=on_worker, cross_node_handoffs=cross_node_handoffs,
        cross_node_bytes=cross_node_bytes, killed_at=killed_at, turns=len(turns), turns_after_kill=len(after),
        lost=sum(t.lost for t in turns), retried=sum(t.attempts > 1 for t in turns),
        p50_turn_s_before=_p50([t.seconds for t in before]), max_turn_s_after=max((t.seconds for t in after), default=math.nan),
        moved=len(recovered), recovery_s=recovery, resumed_streams=resumed_streams, leftover_processes=leftover_processes,
        rejoin_s=rejoin_s,
    )


def _worst(values: Sequence[float]) -> float:
    """The largest value; nan when any is nan (a cycle that measured nothing fails the line)."""
    return math.nan if not values or any(math.isnan(v) for v in values) else max(values)


def _fmt(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if math.isinf(x) else f"{x:.1f}")


def result_line(cycles: Sequence[CycleStats]) -> str:
    """RESULT over all cycles: totals, and the worst cycle's times (a cycle whose victim held no
    conversation has recovery nan: it tested nothing, and makes the line's recovery nan)."""
    if not cycles:
        return "RESULT nodes=2 cycles=0 cross_node_handoffs=0 lost_turns=nan turns_after_kill=0 recovery_s_max=nan rejoin_s_max=nan"
    return (f"RESULT nodes=2 cycles={len(cycles)} cross_node_handoffs={sum(c.cross_node_handoffs for c in cycles)} "
            f"lost_turns={sum(c.lost for c in cycles)} turns_after_kill={sum(c.turns_after_kill for c in cycles)} "
            f"moved_conversations={sum(c.moved for c in cycles)} resumed_streams={sum(c.resumed_streams for c in cycles)} "
            f"recovery_s_max={_fmt(_worst([c.recovery_s for c in cycles]))} "
            f"max_turn_s_after_kill={_fmt(_worst([c.max_turn_s_after for c in cycles]))} "
            f"rejoin_s_max={_fmt(_worst([c.rejoin_s for c in cycles]))} leftover_processes={sum(c.leftover_processes for c in cycles)}")
