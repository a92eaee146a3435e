"""Engines that share one machine slow each other down: a step runs longer while another engine of
the same host is in a step of its own.

Measured on `bench conserve`'s step traces (runs/bench-conserve-20261207-114300, two engines each
pinned to its own core of a 2-core host): a batch-1 decode step took 56–61 ms with the other engine
idle, 72–79 ms with it decoding and 63–75 ms with it prefilling. Separate cores still share the
caches, the memory bus and the serving stack's threads. On GPUs each engine has its own device, so
the simulator's GPU fleets use no shared host and are not slowed.

Model, the same in the fit (served_steps.py) and in the simulator (engine.py):
    step time = base(step) · (1 + κ · m)
with m the number of *other* engines of the host in a step when this one starts (what a simulator
knows at that moment), and κ ≥ 0 fitted on the served steps (`CpuStepModel.contention`).
"""

from __future__ import annotations


class SharedHost:
    """The engines of one machine: which of them are in a step now, and the slowdown κ per busy
    neighbour. Invariant: `busy` holds only engines that called `begin` and not yet `end`."""

    def __init__(self, contention: float):
        if not contention >= 0:
            raise ValueError(f"contention must be a number >= 0, got {contention}")
        self.contention = contention
        self.busy: set[str] = set()

    def begin(self, engine_id: str) -> float:
        """`engine_id` starts a step: the factor its step time is multiplied by."""
        neighbours = len(self.busy) - (engine_id in self.busy)
        self.busy.add(engine_id)
        return slowdown(self.contention, neighbours)

    def end(self, engine_id: str) -> None:
        self.busy.discard(engine_id)


def slowdown(contention: float, neighbours: int) -> float:
    """1 + κ·m: a step's time factor with m neighbours in a step of their own."""
    return 1.0 + contention * neighbours
