"""GPU energy from utilization: power = idle + (TDP - idle) × utilization, utilization = the
fraction of the time the GPU ran an engine step (its busy seconds / the run's seconds).

TDPs are NVIDIA's published board powers: H200 SXM up to 700 W (H200 datasheet), L40S 350 W
(L40S datasheet). Idle is IDLE_FRACTION of TDP, an assumption (not measured here): idle
datacenter GPUs typically read ~10-20 % of TDP in nvidia-smi. A linear power model ignores
that decode (memory-bound) draws less than prefill (compute-bound) at equal busy time.

Per conversation, in steady state: the idle floor is charged over the arrival horizon only
(`powered_s`; after it the fleet would be serving later arrivals, and a short run's drain tail
would otherwise dominate), the dynamic part for every step the run took; divided by the
conversations that completed.
"""
from __future__ import annotations

from dataclasses import dataclass

TDP_W = {"h200_sxm": 700.0, "l40s": 350.0}
IDLE_FRACTION = 0.15


@dataclass(frozen=True)
class GpuUse:
    gpu: str
    busy_s: float


def gpu_energy_j(use: GpuUse, powered_s: float, idle_fraction: float = IDLE_FRACTION) -> float:
    """Joules of one GPU: idle power over `powered_s`, plus (TDP - idle) for each busy second.
    (busy = powered: TDP × powered_s, utilization 1.)"""
    if powered_s <= 0 or use.busy_s < 0:
        raise ValueError(f"need busy ({use.busy_s}) >= 0 and powered ({powered_s}) > 0")
    tdp = TDP_W[use.gpu]
    idle = idle_fraction * tdp
    return idle * powered_s + (tdp - idle) * use.busy_s


def energy_per_conversation_j(uses: list[GpuUse], powered_s: float, completed: int) -> float:
    """The fleet's energy per completed conversation (+inf when none completed: failed
    conversations cost energy and count for nothing)."""
    total = sum(gpu_energy_j(u, powered_s) for u in uses)
    return total / completed if completed else float("inf")
