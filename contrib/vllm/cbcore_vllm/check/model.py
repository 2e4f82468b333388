"""The tiny random Llama both engines run when no model is given: decisions, not tokens, are under test.

Head size 64 and block sizes that are multiples of 32 are what vLLM's CPU
attention accepts; the weights are random with a fixed seed, so cbcore's
engine and vLLM compute the same greedy tokens from them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.2,
    )


def tiny_llama_config(path: Path) -> Path:
    """Only the config (what vLLM's ModelConfig reads): enough to build a scheduler."""
    _config().save_pretrained(path)
    return path


def tiny_llama(path: Path) -> Path:
    """The config and float32 weights (seed 0) in ``path``; returns ``path``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config()).to(torch.float32).save_pretrained(path)
    return path
