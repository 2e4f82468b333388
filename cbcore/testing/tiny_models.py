"""Tiny random causal LMs built from configs, for offline tests.

Weights are drawn with a fixed seed and a larger-than-usual init scale so that
logits are spread out and attention actually matters: a model whose output
ignores the context would let a broken mask pass the equivalence tests.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
)

VOCAB = 512
EOS = 2


def _llama() -> PretrainedConfig:  # GQA: 4 query heads share 2 KV heads
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
        initializer_range=0.2,
    )


def _gpt2() -> PretrainedConfig:
    return GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=512,
        bos_token_id=1,
        eos_token_id=EOS,
        initializer_range=0.2,
    )


def _qwen2() -> PretrainedConfig:  # GQA 4:1 and biased q/k/v projections
    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=EOS,
        initializer_range=0.2,
        tie_word_embeddings=True,
    )


def _mistral() -> PretrainedConfig:  # a sliding window short enough to matter
    return MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        sliding_window=24,
        bos_token_id=1,
        eos_token_id=EOS,
        initializer_range=0.2,
    )


TINY_FAMILIES: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": _llama,
    "gpt2": _gpt2,
    "qwen2": _qwen2,
    "mistral": _mistral,
}


def tiny_model(family: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A small random model of ``family`` (see :data:`TINY_FAMILIES`), in eval mode."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; known: {sorted(TINY_FAMILIES)}")
    config = TINY_FAMILIES[family]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = EOS
    return model.eval()


def random_prompts(n: int, min_len: int = 1, max_len: int = 64, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of random length in [min_len, max_len], avoiding the special ids."""
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def shared_prefix_prompts(
    n: int, stem_lengths: tuple[int, ...] = (37, 22), max_tail: int = 20, seed: int = 0
) -> list[list[int]]:
    """``n`` prompts that reuse a few stems (system prompts, earlier turns) cut at random lengths.

    Prompt ``i`` takes stem ``i % len(stem_lengths)`` up to a random cut (often
    inside a KV block) and adds a random tail of up to ``max_tail`` tokens; every
    fourth prompt instead extends an earlier prompt whole, as the next turn of a
    conversation would. So prefix-cache hits end at assorted offsets.
    """
    rng = random.Random(seed)
    stems = [[rng.randrange(3, VOCAB) for _ in range(length)] for length in stem_lengths]
    prompts: list[list[int]] = []
    for i in range(n):
        if i % 4 == 3:
            base = list(prompts[rng.randrange(len(prompts))])
        else:
            stem = stems[i % len(stems)]
            base = stem[: rng.randint(len(stem) // 2, len(stem))]
        prompts.append(base + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, max_tail))])
    return prompts

