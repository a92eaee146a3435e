"""Tiny seeded random-weight models, one per RoPE family the segment connector re-rotates, for the
exact-injection checks on CPU (tests/e2e/test_rope_injection.py); baton/tools/provision.py builds
their folders with SmolLM2's tokenizer (same vocabulary, same ids).

- ``tiny-llama31``: Llama-3.1-style, llama3 rope scaling (factor 8, original context 256, so a
  few-hundred-token prompt already crosses into the scaled range), neox pairing, 2 query / 1 KV heads;
- ``tiny-qwen2``: Qwen2-style (q/k/v bias, rope_theta 1e6), neox pairing;
- ``tiny-gptj``: GPT-J, vLLM's gpt_j.py: interleaved (gptj, is_neox_style=False) pairing over a
  partial rotary_dim 32 of head 64.
Each: hidden 128, 2 layers, 2 heads of 64, bf16, max 2048 positions: an engine builds in seconds.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from baton.tools.tiny_lfm2 import SMOLLM2_BOS_ID, SMOLLM2_EOS_ID

HIDDEN, LAYERS, HEADS, MAX_POSITIONS = 128, 2, 2, 2048
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}

_COMMON = {"bos_token_id": SMOLLM2_BOS_ID, "eos_token_id": SMOLLM2_EOS_ID, "pad_token_id": SMOLLM2_EOS_ID,
           # wider than the default 0.02: greedy output varies token to token instead of repeating one
           # token, so a wrongly rotated key shows up as different tokens
           "initializer_range": 0.1, "dtype": "bfloat16"}


def tiny_llama31_config(vocab_size: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=1, head_dim=HIDDEN // HEADS,
                       max_position_embeddings=MAX_POSITIONS, rope_parameters=dict(LLAMA3_ROPE),
                       tie_word_embeddings=True, **_COMMON)


def tiny_qwen2_config(vocab_size: int) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=1, max_position_embeddings=MAX_POSITIONS,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                       tie_word_embeddings=True, **_COMMON)


def tiny_gptj_config(vocab_size: int) -> Any:
    from transformers import GPTJConfig

    config = GPTJConfig(vocab_size=vocab_size, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, rotary_dim=32,
                        n_positions=MAX_POSITIONS, tie_word_embeddings=False, **_COMMON)
    # vLLM's gpt_j.py adds partial_rotary_factor into config.rope_parameters: it must be a dict
    # (transformers 5.19's GPTJConfig leaves it None); GPT-J's base is 10000
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    return config


TINY_ROPE_CONFIGS: dict[str, Callable[[int], Any]] = {
    "tiny-llama31": tiny_llama31_config,
    "tiny-qwen2": tiny_qwen2_config,
    "tiny-gptj": tiny_gptj_config,
}


def save_tiny_rope_weights(name: str, out: Path, vocab_size: int, seed: int) -> None:
    """Config, generation config and bf16 weights of `name`; the same seed gives identical tensors."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = TINY_ROPE_CONFIGS[name](vocab_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=SMOLLM2_BOS_ID, eos_token_id=SMOLLM2_EOS_ID, pad_token_id=SMOLLM2_EOS_ID
    )
    model.save_pretrained(out)
