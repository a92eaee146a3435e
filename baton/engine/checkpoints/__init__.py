"""Sparse recurrent-state checkpoints for hybrid models: histogram → exact DP plan → enforcement.

histogram.py  observed match depths per prefix family (decay, frozen modes, re-solve trigger)
planner.py    exact DP: ≤ M positions minimising expected recomputed tokens
baselines.py  none, block-dense, uniform (vLLM's interval), balanced, √L, dyadic
plan.py       CheckpointPlan (typed result) and the exact cost every strategy is judged by
policy.py     per-family plans kept current from observations and continuation (drives the engine and the bench)
depth.py      prefix-match depth of a prompt against those seen before, and the earlier tail it reaches
config.py     CheckpointConfig (pydantic, extra="forbid")
scheduler.py  the one vLLM seam: a Scheduler subclass (SchedulerConfig.scheduler_cls)
"""
