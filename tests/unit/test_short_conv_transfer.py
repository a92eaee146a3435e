"""kv_transfer/short_conv.py: LFM2's conv state split so vLLM's NIXL hybrid descriptors tile it exactly."""
from __future__ import annotations

import pytest
import torch

from kv_transfer import short_conv


def short_conv_spec(dim: int = 256, rows: int = 2, dtype: torch.dtype = torch.float32):
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=128, shapes=((dim, rows),), dtypes=(dtype,),
                     mamba_type=MambaAttentionBackendEnum.SHORT_CONV)


def set_layout(monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    """vLLM reads the layout once per process (an lru_cache over envs): clear it now and after."""
    import vllm.envs as envs
    from vllm.model_executor.layers.mamba import mamba_utils

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", layout)
    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    mamba_utils.get_conv_state_layout.cache_clear()
    if mamba_utils.get_conv_state_layout() != layout:
        pytest.fail(f"VLLM_SSM_CONV_STATE_LAYOUT={layout} did not take effect in this process")


@pytest.fixture
def ds_layout(monkeypatch: pytest.MonkeyPatch):
    set_layout(monkeypatch, "DS")
    yield
    from vllm.model_executor.layers.mamba import mamba_utils

    mamba_utils.get_conv_state_layout.cache_clear()


@pytest.mark.parametrize(("dim", "rows", "size"), [(256, 2, 4), (1024, 3, 2), (2, 1, 1)])
def test_the_two_regions_tile_the_conv_state_exactly(dim: int, rows: int, size: int) -> None:
    dims, (ssm_at, ssm_len) = short_conv.short_conv_split(dim, rows, size)
    conv_len = dims[0] * rows * size
    assert conv_len == ssm_at  # the "SSM" read starts where the conv region ends
    assert conv_len + ssm_len == dim * rows * size  # and ends at the end of the state: every byte once
    assert ssm_len > 0 and conv_len > 0  # no zero-length NIXL descriptor


def test_a_state_too_small_to_split_is_refused() -> None:
    with pytest.raises(ValueError, match="too small"):
        short_conv.short_conv_split(1, 2, 4)


def test_derive_builds_vllm_split_info_for_a_ds_short_conv_spec(ds_layout: None) -> None:
    info = short_conv.derive_short_conv_split(short_conv_spec(256, 2, torch.float32))
    assert info.local_conv_offsets == [(0, 255 * 2 * 4)]
    assert info.ssm_sizes == (255 * 2 * 4, 2 * 4)
    assert info.remote_conv_offsets(0, 1) == info.local_conv_offsets  # equal TP: P's page reads as D's


def test_unequal_tensor_parallelism_is_refused_with_a_clear_error(ds_layout: None) -> None:
    info = short_conv.derive_short_conv_split(short_conv_spec())
    for ratio in (2, -2):
        with pytest.raises(short_conv.UnequalTensorParallel, match="equal tensor parallelism"):
            info.remote_conv_offsets(0, ratio)


def test_the_sd_layout_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.layers.mamba import mamba_utils

    set_layout(monkeypatch, "SD")
    try:
        with pytest.raises(RuntimeError, match="VLLM_SSM_CONV_STATE_LAYOUT=DS"):
            short_conv.derive_short_conv_split(short_conv_spec())
    finally:
        mamba_utils.get_conv_state_layout.cache_clear()


def test_install_answers_short_conv_and_delegates_every_other_type(
        monkeypatch: pytest.MonkeyPatch, ds_layout: None) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    seen = []
    monkeypatch.setattr(base_worker, "derive_mamba_conv_split", lambda spec, tp: seen.append((spec, tp)) or "vllm")
    monkeypatch.setattr(short_conv, "_installed", False)
    assert short_conv.install()
    assert short_conv.install()  # idempotent: wraps once
    derive = base_worker.derive_mamba_conv_split
    assert derive(short_conv_spec(), 1).ssm_sizes == (255 * 8, 8)
    mamba2 = MambaSpec(block_size=128, shapes=((96, 3), (4, 16)), dtypes=(torch.float32, torch.float32),
                       mamba_type=MambaAttentionBackendEnum.MAMBA2)
    assert derive(mamba2, 2) == "vllm" and seen == [(mamba2, 2)]
