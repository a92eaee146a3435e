"""Short-convolution (LFM2) recurrent state through vLLM's own NIXL hybrid transfer.

vLLM 0.32's NIXL worker moves a hybrid model's recurrent state as, per recurrent layer and block,
the conv state's sub-projections plus one "SSM temporal" region
(`ssm_conv_transfer_utils.derive_mamba_conv_split`); it knows Mamba1, Mamba2 and GDN and refuses
every other layer type at start-up ("Conv transfer only supports Mamba1, Mamba2 and GDN models"),
so an LFM2 engine with a NIXL connector cannot even be built.

An LFM2 short-conv layer holds one state only: the conv state, `(conv_dim, L_cache - 1)` per
rank, dim-first under VLLM_SSM_CONV_STATE_LAYOUT=DS, at the start of the layer's page. It is
moved through the same descriptors with this split of its bytes:
- "conv" region = the first `conv_dim - 1` channels (one sub-projection);
- "SSM" region  = the last channel, which the worker addresses at `conv_bytes` past the page start.

The two regions tile the conv state exactly, so the decoder reads every byte of it and nothing
else. This is exact only when both sides cut the channels alike, i.e. equal tensor parallelism
(`tp_ratio == 1`); any other ratio is refused when the remote side's descriptors are built.

`install()` wraps the name the worker module calls (`base_worker.derive_mamba_conv_split`) so the
wrapper answers for short-conv specs and delegates every other type to vLLM. It imports vLLM:
call it in the engine process only (CountingNixlConnector does, before its worker starts).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

logger = logging.getLogger("baton.kv_transfer")

_installed = False


class UnequalTensorParallel(NotImplementedError):
    """A short-conv state cannot be split across unequal prefill/decode tensor parallelism."""


def short_conv_split(conv_dim: int, conv_rows: int, dtype_size: int) -> tuple[tuple[int, ...], tuple[int, int]]:
    """(local_proj_dims, ssm_sizes) that tile one DS conv state `(conv_dim, conv_rows)` exactly.

    ssm_sizes[0] is where the worker starts the "SSM" read (bytes of the first conv_dim - 1
    channels), ssm_sizes[1] its length (one channel)."""
    if conv_dim < 2 or conv_rows < 1 or dtype_size < 1:
        raise ValueError(f"short-conv state too small to split: dim={conv_dim} rows={conv_rows} dtype={dtype_size}")
    channel = conv_rows * dtype_size
    return (conv_dim - 1,), ((conv_dim - 1) * channel, channel)


def _split_info_class() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import MambaConvSplitInfo

    @dataclasses.dataclass(frozen=True)
    class ShortConvSplitInfo(MambaConvSplitInfo):  # type: ignore[misc, valid-type]
        def remote_conv_offsets(self, local_rank_offset: int, tp_ratio: int) -> list[tuple[int, int]]:
            if tp_ratio != 1:
                raise UnequalTensorParallel(
                    f"short-conv (LFM2) state transfer needs equal tensor parallelism on prefill and decode "
                    f"(tp_ratio={tp_ratio}): set the same tensor_parallel_size on both pools"
                )
            return super().remote_conv_offsets(local_rank_offset, tp_ratio)

    return ShortConvSplitInfo


def derive_short_conv_split(mamba_spec: Any) -> Any:
    """MambaConvSplitInfo for a SHORT_CONV MambaSpec (one DS conv state per layer)."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    if not is_conv_state_dim_first():
        raise RuntimeError("short-conv state transfer needs VLLM_SSM_CONV_STATE_LAYOUT=DS in the engine environment")
    if len(mamba_spec.shapes) != 1 or len(mamba_spec.shapes[0]) != 2:
        raise ValueError(f"expected one 2-D short-conv state, got shapes {mamba_spec.shapes}")
    conv_dim, conv_rows = mamba_spec.shapes[0]
    dtype_size = torch.tensor([], dtype=mamba_spec.dtypes[0]).element_size()
    dims, sizes = short_conv_split(int(conv_dim), int(conv_rows), dtype_size)
    return _split_info_class()(conv_rows=int(conv_rows), local_proj_dims=dims, conv_dtype_size=dtype_size,
                               ssm_sizes=sizes)


def install() -> bool:
    """Teach this process's NIXL worker the short-conv split; True when installed (idempotent)."""
    global _installed
    if _installed:
        return True
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    except ImportError as e:  # another vLLM layout: keep vLLM's own behaviour
        logger.warning("short-conv NIXL transfer not installed (%s): LFM2 P/D will be refused by vLLM", e)
        return False
    original = getattr(base_worker, "derive_mamba_conv_split", None)
    if original is None:
        logger.warning("vLLM's NIXL worker has no derive_mamba_conv_split: short-conv transfer not installed")
        return False

    def derive(mamba_spec: Any, local_tp: int) -> Any:
        if mamba_spec.mamba_type == MambaAttentionBackendEnum.SHORT_CONV:
            return derive_short_conv_split(mamba_spec)
        return original(mamba_spec, local_tp)

    base_worker.derive_mamba_conv_split = derive
    _installed = True
    return True
