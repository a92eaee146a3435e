"""Re-rotation against vLLM's own rotary embedding, for every RoPE family vLLM builds on CPU.

For each family: build vLLM's module with `get_rope` (as a model class does), take the spec from
it (kv_transfer/rope.py rope_from_module), compute vLLM's own key at p and at q with the module's
forward, and check that removing RoPE at p and applying it at q reproduces vLLM's key at q —
positions beyond original_max_position included, where scaling changes the table.

Tolerances (relative to the largest key element):
- float32 modules: 1e-5 (fp32 rounding only; YaRN's and longrope's mscale included; measured
  ≤ 1.3e-7 over every family);
- bfloat16 modules (the model dtype; vLLM's forward_native rotates in bf16): the key at p is bf16,
  and vLLM's own key at q carries bf16 rounding of each product and of the sum: 3 bf16 ulps,
  3 * 2^-8 ≈ 1.2e-2 (measured 3.1e-3 … 6.9e-3).
The negative checks show these can fail: neox pairing on a gptj model, plain RoPE on a llama3
model beyond its original context, and a forgotten mscale (in the stored form) are all far outside them."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from kv_transfer.rope import (
    RopeSpec,
    Rotator,
    UnsupportedRope,
    apply_rope,
    remove_rope,
    rope_from_model,
    rope_from_module,
    rope_from_vllm_config,
)

HEAD, HEADS = 64, 2


@contextlib.contextmanager
def vllm_context(max_model_len: int = 4096) -> Iterator[None]:
    """What vLLM's rotary modules read while they are built: the compilation config (custom ops)
    and, for longrope, the engine's max_model_len."""
    from vllm.config import VllmConfig, set_current_vllm_config

    cfg = SimpleNamespace(compilation_config=VllmConfig().compilation_config,
                          model_config=SimpleNamespace(max_model_len=max_model_len))
    with set_current_vllm_config(cfg):  # type: ignore[arg-type]
        yield


@dataclass(frozen=True)
class Family:
    name: str
    params: dict[str, Any]
    max_position: int
    positions: tuple[tuple[int, int], ...]  # (p, q) moves to check
    neox: bool = True
    max_model_len: int = 4096
    head: int = HEAD
    rotary_dim: int | None = None  # None: head * partial_rotary_factor


FAR = ((0, 5), (7, 900), (900, 7), (100, 3000), (3000, 4000), (4095, 1))  # crosses original max 1024
NEAR = ((0, 5), (7, 900), (900, 7), (1000, 3), (3, 1023))
ORIG = 1024
HALF = HEAD // 2

FAMILIES = [
    Family("default", {"rope_type": "default", "rope_theta": 10000.0}, 4096, FAR),
    Family("linear", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, 4096, FAR),
    Family("dynamic", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0, "max_trained_positions": ORIG}, 4096, FAR),
    Family("llama3", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": ORIG}, 4096, FAR),
    Family("yarn", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": ORIG}, 4096, FAR),
    Family("longrope-long", {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": ORIG,
                             "short_factor": [1.0 + i / HALF for i in range(HALF)],
                             "long_factor": [1.0 + 4 * i / HALF for i in range(HALF)]}, 4096, FAR, max_model_len=4096),
    Family("longrope-short", {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": ORIG,
                              "short_factor": [1.0 + i / HALF for i in range(HALF)],
                              "long_factor": [1.0 + 4 * i / HALF for i in range(HALF)]}, 4097, NEAR, max_model_len=ORIG),
    Family("ntk", {"rope_type": "ntk", "rope_theta": 10000.0, "factor": 4.0}, 4096, FAR),
    Family("proportional", {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, 4096, FAR,
           rotary_dim=HEAD),  # Gemma 4: the whole head turns, the unrotated dims at frequency 0
    Family("gptj", {"rope_type": "default", "rope_theta": 10000.0}, 4096, FAR, neox=False),
    Family("gptj-partial", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}, 4096, FAR,
           neox=False, head=256),  # GPT-J itself: rotary_dim 64 of head 256
    Family("partial", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, 4096, FAR),
    Family("yarn-partial", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "partial_rotary_factor": 0.5,
                            "original_max_position_embeddings": ORIG}, 4096, FAR),
]

TOL = {torch.float32: 1e-5, torch.bfloat16: 3 * 2**-8}


def vllm_rope(f: Family, dtype: torch.dtype) -> Any:
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with vllm_context(f.max_model_len):
        return get_rope(f.head, max_position=f.max_position, is_neox_style=f.neox, rope_parameters=dict(f.params), dtype=dtype)


def vllm_key(module: Any, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """vLLM's own key at `positions` for pre-RoPE keys k [T, H, D] (its forward_native, or longrope's forward)."""
    t = k.shape[0]
    q = torch.zeros(t, HEADS * k.shape[-1], dtype=k.dtype)
    fwd = getattr(module, "forward_native", None) or module.forward
    _, out = fwd(positions, q, k.reshape(t, -1).clone())
    return out.reshape(k.shape)


def random_keys(t: int, head: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, HEADS, head, generator=g).to(dtype)


def move_error(module: Any, spec: RopeSpec, f: Family, dtype: torch.dtype) -> float:
    """max |moved(p→q) - vLLM's key at q| / max |key| over the family's moves."""
    p = torch.tensor([a for a, _ in f.positions])
    q = torch.tensor([b for _, b in f.positions])
    k = random_keys(len(f.positions), f.head, dtype)
    at_p, at_q = vllm_key(module, k, p), vllm_key(module, k, q)
    moved = apply_rope(remove_rope(at_p, p, spec), q, spec)
    return ((moved - at_q.float()).abs().max() / at_q.float().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_move_p_to_q_reproduces_vllms_key_at_q(family: Family, dtype: torch.dtype) -> None:
    module = vllm_rope(family, dtype)
    spec = rope_from_module(module)
    assert spec.style == ("neox" if family.neox else "gptj")
    assert spec.head_dim == family.head
    assert spec.rotary_dim == (family.rotary_dim or int(family.head * family.params.get("partial_rotary_factor", 1.0)))
    assert spec.max_positions > max(max(pq) for pq in family.positions)
    assert move_error(module, spec, family, dtype) < TOL[dtype]


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_the_position_really_matters(family: Family) -> None:
    """Guard against a vacuous pass: vLLM's keys at p and q differ far beyond the tolerance."""
    module = vllm_rope(family, torch.float32)
    p = torch.tensor([a for a, _ in family.positions])
    q = torch.tensor([b for _, b in family.positions])
    k = random_keys(len(p), family.head, torch.float32)
    assert (vllm_key(module, k, p) - vllm_key(module, k, q)).abs().max().item() > 0.1


def test_pass_through_dims_of_partial_rotary_are_untouched() -> None:
    f = next(x for x in FAMILIES if x.name == "partial")
    spec = rope_from_module(vllm_rope(f, torch.float32))
    k = random_keys(3, HEAD, torch.float32)
    out = apply_rope(k, torch.tensor([5, 100, 4000]), spec)
    assert torch.equal(out[..., spec.rotary_dim:], k[..., spec.rotary_dim:])
    assert (out[..., :spec.rotary_dim] - k[..., :spec.rotary_dim]).abs().max().item() > 0.1


@pytest.mark.parametrize("name", ["gptj", "gptj-partial", "partial", "yarn", "llama3"])
def test_fused_kernel_matches_the_torch_path(name: str) -> None:
    """The worker's Rotator (vLLM's fused kernel with the spec's fp32 table) = apply_rope."""
    f = next(x for x in FAMILIES if x.name == name)
    spec = rope_from_module(vllm_rope(f, torch.bfloat16))
    k = torch.randn(2, 5, HEADS, f.head, generator=torch.Generator().manual_seed(3))  # [L, T, H, D]
    positions = torch.tensor([0, 9, 1000, 2048, 4000])
    assert (Rotator(spec).apply(k, positions) - apply_rope(k, positions, spec)).abs().max().item() < 1e-5


# ---- the old path fails (the checks above can fail) -----------------------------------------------

def test_neox_pairing_on_a_gptj_model_mismatches() -> None:
    f = next(x for x in FAMILIES if x.name == "gptj")
    module = vllm_rope(f, torch.float32)
    right = rope_from_module(module)
    neox_only = RopeSpec(head_dim=right.head_dim, style="neox", table=right.table)  # the old hard-coded pairing
    assert move_error(module, right, f, torch.float32) < TOL[torch.float32]
    assert move_error(module, neox_only, f, torch.float32) > 0.1


def test_plain_rope_on_a_llama3_model_mismatches_beyond_its_original_context() -> None:
    f = next(x for x in FAMILIES if x.name == "llama3")
    module = vllm_rope(f, torch.float32)
    plain = RopeSpec.unscaled(HEAD, f.params["rope_theta"], table_dtype=torch.float32, max_positions=4096)
    assert move_error(module, plain, f, torch.float32) > 0.1


@pytest.mark.parametrize("name", ["yarn", "longrope-long"])
def test_position_free_keys_are_the_models_pre_rope_keys_with_mscale_divided_out(name: str) -> None:
    """YaRN and longrope scale cos and sin by mscale. A move p→q cancels it either way, but the
    stored position-free form must be the model's own pre-RoPE key (segments from different
    captures are laid side by side): a unit-norm table would leave it scaled by mscale."""
    f = next(x for x in FAMILIES if x.name == name)
    module = vllm_rope(f, torch.float32)
    right = rope_from_module(module)
    p = torch.tensor([5, 900, 3000])
    k = random_keys(3, HEAD, torch.float32)
    at_p = vllm_key(module, k, p)
    assert (remove_rope(at_p, p, right) - k).abs().max().item() < 1e-5 * k.abs().max().item()
    row_norm = right.table[:, : HEAD // 2].square() + right.table[:, HEAD // 2:].square()
    mscale = float(row_norm[p].sqrt().mean())
    assert mscale > 1.05
    unit = RopeSpec(head_dim=HEAD, style="neox", table=right.table / mscale)
    assert (remove_rope(at_p, p, unit) - k).abs().max().item() > 0.02 * k.abs().max().item()


# ---- unsupported: a clear reason, never a wrong rotation ------------------------------------------

@pytest.mark.parametrize(("params", "why"), [
    ({"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [16, 8, 8]}, "MRotaryEmbedding"),
    ({"rope_type": "deepseek_yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": ORIG},
     "DeepseekScalingRotaryEmbedding"),
])
def test_rotations_that_are_not_one_table_by_position_are_unsupported(params: dict[str, Any], why: str) -> None:
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with vllm_context():
        module = get_rope(HEAD, max_position=4096, rope_parameters=params, dtype=torch.float32)
    with pytest.raises(UnsupportedRope, match=why):
        rope_from_module(module)


@pytest.mark.parametrize("cls_name", ["DualChunkRotaryEmbedding", "FourierRotaryEmbedding"])
def test_dual_chunk_and_fourier_rope_are_unsupported(cls_name: str) -> None:
    """Neither builds on CPU with toy arguments: an empty instance of the class is enough here."""
    import vllm.model_executor.layers.rotary_embedding as vllm_rope_module

    cls = getattr(vllm_rope_module, cls_name)
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    with pytest.raises(UnsupportedRope, match=cls_name):
        rope_from_module(module)


# ---- from a loaded model, and from an engine config -----------------------------------------------

class _Attn(nn.Module):
    def __init__(self, rope: Any):
        super().__init__()
        self.rotary_emb = rope


def _model(*ropes: Any) -> nn.Module:
    return nn.ModuleList([_Attn(r) for r in ropes])


def test_rope_from_model_takes_the_layers_module() -> None:
    module = vllm_rope(FAMILIES[3], torch.bfloat16)  # llama3
    spec = rope_from_model(_model(module, module))
    assert spec.same_rotation(rope_from_module(module)) and spec.source.startswith("Llama3")


def test_layers_with_different_rotations_are_unsupported() -> None:
    a, b = vllm_rope(FAMILIES[0], torch.float32), vllm_rope(FAMILIES[1], torch.float32)
    with pytest.raises(UnsupportedRope, match="different rotary embeddings"):
        rope_from_model(_model(a, b))
    with pytest.raises(UnsupportedRope, match="no rotary embedding"):
        rope_from_model(nn.Linear(2, 2))


def _engine_config(hf: dict[str, Any], dtype: torch.dtype = torch.bfloat16, max_model_len: int = 2048) -> Any:
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(**hf), dtype=dtype, max_model_len=max_model_len))


def test_engine_config_of_a_gptj_model_builds_the_interleaved_partial_module() -> None:
    hf = {"architectures": ["GPTJForCausalLM"], "hidden_size": 512, "num_attention_heads": 2, "rotary_dim": 64,
          "max_position_embeddings": 2048, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    spec = rope_from_vllm_config(_engine_config(hf))
    assert (spec.style, spec.head_dim, spec.rotary_dim) == ("gptj", 256, 64)


def test_engine_config_of_a_llama31_model_builds_the_llama3_module() -> None:
    params = {**FAMILIES[3].params}
    hf = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "num_attention_heads": 2, "head_dim": 64,
          "max_position_embeddings": 4096, "rope_parameters": params}
    spec = rope_from_vllm_config(_engine_config(hf, torch.float32))
    assert spec.same_rotation(rope_from_module(vllm_rope(FAMILIES[3], torch.float32)))
    # the memoized module is the one a model built with the same arguments holds
    from vllm.model_executor.layers.rotary_embedding import get_rope

    assert get_rope(64, max_position=4096, is_neox_style=True, rope_parameters=dict(params), dtype=torch.float32) \
        is vllm_rope(FAMILIES[3], torch.float32)


def test_engine_config_with_unbuildable_rope_is_unsupported_not_an_error() -> None:
    hf = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "num_attention_heads": 2,
          "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "no-such-rope", "rope_theta": 1.0}}
    with pytest.raises(UnsupportedRope, match="get_rope"):
        rope_from_vllm_config(_engine_config(hf))


def test_the_segment_worker_takes_the_loaded_models_rotation() -> None:
    """bind_model (run through LLMEngine.apply_model at engine start) replaces the config's
    rotation with the model's; a model it cannot re-rotate turns the worker's injection off."""
    from kv_transfer.segment_worker import SegmentWorker

    plain = RopeSpec.unscaled(HEAD, 500000.0, max_positions=4096)
    worker = SegmentWorker(block_size=16, dtype=torch.bfloat16, rope=plain, max_positions=4096)
    llama3 = vllm_rope(FAMILIES[3], torch.bfloat16)
    note = worker.bind_model(_model(llama3, llama3))
    assert worker.rope is not None and worker.rope.source.startswith("Llama3") and "replaces" in note
    assert worker.bind_model(_model(llama3)).endswith(")")  # the same again: agreed, nothing replaced
    assert "off" in worker.bind_model(nn.Linear(2, 2)) and worker.rope is None
