"""Where the ingress sends one turn: the directory's TurnPlan as this ingress can apply it.

The conversation directory answers a router.policy.TurnPlan. The ingress may have no directory,
the directory may fail or time out (its plan is advice: serving goes on, placed by load), and
this ingress may have no prefill pool. `Placement` is the one value that says what happens:

  decode_replica  the decoder to target; None: let the Serve router place the turn by load
  remote_prefill  prefill on the prefill pool first (only when the plan asks and a pool exists)
  prefill_replica the prefill replica to target (the directory's choice); None: by load
  turn_index      the turn's index in its conversation (for per-turn metrics); None outside one
  reason          the plan's reason, or "by_load" when there is no plan
"""
from __future__ import annotations

from dataclasses import dataclass

from router.policy import TurnPlan

BY_LOAD = "by_load"


@dataclass(frozen=True)
class Placement:
    decode_replica: str | None
    remote_prefill: bool
    turn_index: int | None
    reason: str
    prefill_replica: str | None = None

    @classmethod
    def by_load(cls) -> Placement:
        """No plan (no directory, or it could not answer): any decoder, prefilled locally."""
        return cls(decode_replica=None, remote_prefill=False, turn_index=None, reason=BY_LOAD)

    @classmethod
    def of(cls, plan: TurnPlan, *, prefill_pool: bool, in_conversation: bool) -> Placement:
        """The plan as applied here: a remote prefill needs a prefill pool, a turn index a conversation."""
        return cls(
            decode_replica=plan.decode_replica,
            remote_prefill=plan.remote_prefill and prefill_pool,
            turn_index=plan.turn_index if in_conversation else None,
            reason=plan.reason,
            prefill_replica=plan.prefill_replica if plan.remote_prefill and prefill_pool else None,
        )
