"""GPU energy from utilization: power = idle + (TDP - idle) × utilization, utilization = the
fraction of the time the GPU ran an engine step (its busy seconds / the run's seconds).

TDPs are NVIDIA's published board powers: H200 SXM up to 700 W (H200 datasheet), L40S 350 W
(L40S datasheet). Idle is IDLE_FRACTION of TDP, an assumption (not measured here): idle
datacenter GPUs typically read ~10-20 % of TDP in nvidia-smi. A linear power model ignores
that decode (memory-bound) draws less than prefill (compute-bound) at equal busy time.
"""
from __future__ import annotations

from dataclasses import dataclass

TDP_W = {"h200_sxm": 700.0, "l40s": 350.0}
IDLE_FRACTION = 0.15


@dataclass(frozen=True)
class GpuUse:
    gpu: str
    busy_s: float


def gpu_energy_j(use: GpuUse, wall_s: float, idle_fraction: float = IDLE_FRACTION) -> float:
    """Joules one GPU drew over `wall_s` seconds, `use.busy_s` of them busy."""
    if wall_s <= 0 or not 0 <= use.busy_s <= wall_s * (1 + 1e-9):
        raise ValueError(f"need 0 <= busy ({use.busy_s}) <= wall ({wall_s}) and wall > 0")
    tdp = TDP_W[use.gpu]
    idle = idle_fraction * tdp
    return idle * wall_s + (tdp - idle) * use.busy_s


def energy_per_conversation_j(uses: list[GpuUse], wall_s: float, completed: int) -> float:
    """The fleet's energy over the run per completed conversation (+inf when none completed:
    failed conversations cost energy and count for nothing)."""
    total = sum(gpu_energy_j(u, wall_s) for u in uses)
    return total / completed if completed else float("inf")
