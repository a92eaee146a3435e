"""baton/sim/energy.py: power = idle + (TDP - idle) × utilization."""
import math

import pytest

from baton.sim.energy import IDLE_FRACTION, GpuUse, energy_per_conversation_j, gpu_energy_j


def test_idle_and_fully_busy_gpus_draw_idle_power_and_tdp():
    assert gpu_energy_j(GpuUse("h200_sxm", 0.0), 10.0) == pytest.approx(IDLE_FRACTION * 700 * 10)
    assert gpu_energy_j(GpuUse("h200_sxm", 10.0), 10.0) == pytest.approx(700 * 10)
    assert gpu_energy_j(GpuUse("l40s", 5.0), 10.0) == pytest.approx(0.15 * 350 * 10 + 0.85 * 350 * 5)


def test_energy_per_conversation_counts_only_completed_ones():
    uses = [GpuUse("h200_sxm", 2.0), GpuUse("l40s", 1.0)]
    total = gpu_energy_j(uses[0], 4.0) + gpu_energy_j(uses[1], 4.0)
    assert energy_per_conversation_j(uses, 4.0, 4) == pytest.approx(total / 4)
    assert math.isinf(energy_per_conversation_j(uses, 4.0, 0))


def test_negative_busy_or_no_powered_time_is_refused():
    with pytest.raises(ValueError):
        gpu_energy_j(GpuUse("h200_sxm", -1.0), 10.0)
    with pytest.raises(ValueError):
        gpu_energy_j(GpuUse("h200_sxm", 1.0), 0.0)
