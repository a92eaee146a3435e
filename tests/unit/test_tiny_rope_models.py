"""The tiny RoPE-family models (baton/tools/tiny_rope.py) the exact-injection e2e checks use:
seeded and deterministic, loadable by transformers' AutoConfig from the saved folder, and the
rotary embedding vLLM's model class builds for each is the family it stands for (no engine)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from baton.tools import provision
from baton.tools.tiny_rope import TINY_ROPE_CONFIGS, save_tiny_rope_weights
from kv_transfer.rope import rope_from_vllm_config

VOCAB = 49152  # SmolLM2's tokenizer

EXPECTED = {  # name: (architecture, pairing, head dim, rotary dim, vLLM module)
    "tiny-llama31": ("LlamaForCausalLM", "neox", 64, 64, "Llama3RotaryEmbedding"),
    "tiny-qwen2": ("Qwen2ForCausalLM", "neox", 64, 64, "RotaryEmbedding"),
    "tiny-gptj": ("GPTJForCausalLM", "gptj", 64, 32, "RotaryEmbedding"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-rope")
    out = {}
    for name in TINY_ROPE_CONFIGS:
        save_tiny_rope_weights(name, root / name, VOCAB, seed=0)
        out[name] = root / name
    return out


def test_names_match_the_provisioned_folders() -> None:
    assert provision.TINY_ROPE_NAMES == tuple(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_folder_loads_with_autoconfig_and_is_tiny(saved: dict[str, Path], name: str) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(saved[name])
    arch = EXPECTED[name][0]
    assert cfg.architectures == [arch]
    assert cfg.vocab_size == VOCAB and cfg.num_hidden_layers == 2 and 64 <= cfg.hidden_size <= 128
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_vllms_rotary_embedding_for_each_is_its_family(saved: dict[str, Path], name: str) -> None:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(saved[name])
    engine = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf, dtype=torch.bfloat16, max_model_len=2048))
    spec = rope_from_vllm_config(engine)
    _, style, head, rotary, module = EXPECTED[name]
    assert (spec.style, spec.head_dim, spec.rotary_dim) == (style, head, rotary)
    assert spec.source.split(" ")[0] == module
    assert spec.max_positions >= 2048


def test_weights_are_deterministic(tmp_path: Path, saved: dict[str, Path]) -> None:
    save_tiny_rope_weights("tiny-gptj", tmp_path / "again", VOCAB, seed=0)
    save_tiny_rope_weights("tiny-gptj", tmp_path / "other", VOCAB, seed=1)
    same, other = (provision.tensor_checksum(tmp_path / n) for n in ("again", "other"))
    assert same == provision.tensor_checksum(saved["tiny-gptj"])
    assert same != other
