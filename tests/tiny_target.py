"""Tiny random targets for fast tests: a real transformers Llama/Qwen3 with the SmolLM2 tokenizer."""

from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.lru_cache(maxsize=1)
def _smollm2_tokenizer():
    from target_server.model_loader import load_tokenizer

    return load_tokenizer("smollm2")


def make_tiny_target(directory: Path, *, arch: str = "llama", num_layers: int = 6, hidden: int = 64, seed: int = 0) -> Path:
    """Save a random model with the SmolLM2 tokenizer (vocab 49152) to ``directory``; returns it."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    tokenizer = _smollm2_tokenizer()
    common = dict(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    config = Qwen3Config(head_dim=hidden // 4, **common) if arch == "qwen3" else LlamaConfig(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
