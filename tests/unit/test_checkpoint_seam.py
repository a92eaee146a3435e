"""The one vLLM seam of sparse checkpoints (baton/engine/checkpoints/scheduler.py) still fits vLLM.

Fails loudly when a vLLM upgrade renames, moves or re-signs a hooked method, or turns
reachable_block_mask into an instance method. Imports vLLM; starts no engine.
"""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.config import CacheConfig, SchedulerConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.core.single_type_kv_cache_manager import MambaManager

from baton.engine.args import checkpoint_engine_args
from baton.engine.checkpoints import scheduler as seam
from baton.engine.checkpoints.config import CheckpointConfig
from baton.engine.checkpoints.plan import CheckpointPlan


@pytest.mark.parametrize("owner, name", list(seam.HOOKED))
def test_hooked_methods_exist_with_expected_parameters(owner: type, name: str) -> None:
    fn = inspect.getattr_static(owner, name, None)
    assert fn is not None, f"vLLM moved {owner.__name__}.{name}: the checkpoint seam must be re-fitted"
    params = tuple(inspect.signature(getattr(owner, name)).parameters)
    expected = tuple(p for p in seam.HOOKED[(owner, name)] if p != "self" or "self" in params)
    assert set(expected) <= set(params), f"vLLM changed {owner.__name__}.{name}{params}; the seam expects {expected}"


def test_reachable_block_mask_stays_a_classmethod() -> None:
    assert isinstance(inspect.getattr_static(MambaManager, "reachable_block_mask"), classmethod)
    assert isinstance(inspect.getattr_static(seam.PlannedMambaManager, "reachable_block_mask"), classmethod)


def test_manager_state_the_seam_reads_is_still_there() -> None:
    src = inspect.getsource(MambaManager)
    for attr in ("self._checkpoints", "self.req_to_blocks", "self.block_pool"):
        assert attr in src, f"MambaManager no longer has {attr}"
    assert "_maybe_evict_cached_block" in inspect.getsource(MambaManager._cache_partial_tail_block)


def test_config_fields_the_seam_sets_exist() -> None:
    kwargs = checkpoint_engine_args(CheckpointConfig())
    fields = set(inspect.signature(EngineArgs).parameters)
    assert set(kwargs) <= fields
    assert "scheduler_cls" in SchedulerConfig.__dataclass_fields__ or hasattr(SchedulerConfig, "scheduler_cls")
    assert hasattr(CacheConfig, "prefix_cache_retention_interval") or "prefix_cache_retention_interval" in str(inspect.signature(CacheConfig))
    assert "additional_config" in str(inspect.signature(VllmConfig))
    assert kwargs["scheduler_cls"] == seam.SCHEDULER_CLS


def test_planned_mask_keeps_exactly_the_planned_positions() -> None:
    cls = type("Planned", (seam.PlannedMambaManager,), {})
    spec = SimpleNamespace(block_size=128)
    cls._active_plan = CheckpointPlan("dp", (256, 640), 2, 128)
    try:
        mask = cls.reachable_block_mask(0, 6, 128, spec, False, retention_interval=None, reachable_boundaries=(768,))
    finally:
        cls._active_plan = None
    assert mask == [False, True, False, False, True, False]  # blocks end at 128, 256, …, 768


def test_engine_config_wires_the_scheduler_only_when_asked() -> None:
    from baton.engine.args import build_engine_spec
    from baton.engine.config import EngineConfig

    def kwargs(**extra: object) -> dict:
        cfg = EngineConfig(model="m", **extra)  # type: ignore[arg-type]
        return build_engine_spec(cfg, role="decode", handoff=False, model_path="/m", on_gpu=False, cache_root="/c").engine_kwargs

    on = kwargs(checkpoints={"strategy": "dp", "budget": 4})
    assert on["scheduler_cls"] == seam.SCHEDULER_CLS and on["prefix_cache_retention_interval"] is None
    assert CheckpointConfig.model_validate(on["additional_config"][seam.CONFIG_KEY]).budget == 4
    assert not {"scheduler_cls", "additional_config", "prefix_cache_retention_interval"} & set(kwargs())
