"""What a request must satisfy before it is queued: refuse now what could never run to completion.

A request that fails after generating has cost compute and tells its caller
late; everything knowable up front (prompt form, vocabulary, the model's
context, the KV cache's size) is checked at ``add_request``.
"""

from __future__ import annotations

from typing import Any

from cbcore.scheduling.block_manager import BlockManager
from cbcore.scheduling.sampling_params import SamplingParams

Prompt = str | list[int]


class RequestError(ValueError):
    """A request was refused before it ran; the message says what was wrong with it."""


def encode_prompt(prompt: Prompt, request_id: str, tokenizer: Any | None) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError(f"request {request_id}: a text prompt needs a tokenizer; pass token ids")
        return list(tokenizer.encode(prompt))
    if not isinstance(prompt, list | tuple) or not all(type(t) is int for t in prompt):
        raise RequestError(f"request {request_id}: a prompt is a string or a list of int token ids")
    return list(prompt)


def check_request(
    token_ids: list[int],
    request_id: str,
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int | None,
    blocks: BlockManager,
) -> None:
    where = f"request {request_id}"
    if not token_ids:
        raise RequestError(f"{where}: the prompt is empty")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"{where}: token id {bad[0]} is outside the vocabulary (size {vocab_size})")
    stops = [t for t in params.stop_token_ids if t >= vocab_size]
    if stops:
        raise RequestError(f"{where}: stop token id {stops[0]} is outside the vocabulary (size {vocab_size})")
    n = len(token_ids)
    if max_model_len is not None:
        if n >= max_model_len:
            raise RequestError(
                f"{where}: the prompt has {n} tokens, which leaves no room in the model's context of "
                f"{max_model_len} tokens"
            )
        if n + params.max_new_tokens > max_model_len:
            raise RequestError(
                f"{where}: the prompt's {n} tokens + max_new_tokens {params.max_new_tokens} exceed the "
                f"model's context of {max_model_len} tokens; lower max_new_tokens to {max_model_len - n} or less"
            )
    if blocks.blocks_for_tokens(n) > blocks.num_blocks:
        raise RequestError(
            f"{where}: the prompt has {n} tokens but the whole KV cache holds {blocks.capacity_tokens} "
            f"({blocks.num_blocks} blocks of {blocks.block_size}); raise kv_cache.num_blocks"
        )
    need = n + params.max_new_tokens - 1  # the last generated token is never fed back: no KV slot
    if blocks.blocks_for_tokens(need) > blocks.num_blocks:
        raise RequestError(
            f"{where}: the prompt's {n} tokens + max_new_tokens {params.max_new_tokens} needs KV for {need} "
            f"tokens but the whole cache holds {blocks.capacity_tokens} ({blocks.num_blocks} blocks of "
            f"{blocks.block_size}); raise kv_cache.num_blocks or lower max_new_tokens"
        )
