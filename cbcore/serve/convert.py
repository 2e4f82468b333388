"""From a validated request body to what the engine takes: token ids, SamplingParams, scheduling fields.

Everything that can be refused is refused here, before the request reaches
the engine and before any token is generated, with the OpenAI field it is
about: a prompt that is empty or longer than the context, a request whose
prompt plus ``max_tokens`` can never fit the model's context or the KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from cbcore.scheduling.request import max_new_tokens_limit
from cbcore.scheduling.sampling_params import GREEDY_BELOW, SamplingParams
from cbcore.serve.errors import ApiError
from cbcore.serve.protocol import ChatRequest, CompletionRequest


@dataclass(frozen=True)
class Limits:
    """What the engine can hold; fixed when it starts, so handlers may read it from any thread."""

    vocab_size: int
    max_model_len: int | None
    kv_tokens: int

    @classmethod
    def of(cls, engine: Any) -> Limits:
        return cls(engine.vocab_size, engine.max_model_len, engine.kv_capacity_tokens)


def single_prompt(body: CompletionRequest) -> str | list[int]:
    """The one prompt of a completions body (a list of one prompt is that prompt)."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ApiError(400, f"{len(prompt)} prompts in one request are not supported; send one", "prompt")
        prompt = prompt[0]
    return prompt  # type: ignore[return-value]


def chat_messages(body: ChatRequest, tokenizer: Any) -> list[dict[str, Any]]:
    """The messages as the chat template reads them (content as one string)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
    return [{**m.model_dump(exclude_none=True), "content": m.text()} for m in body.messages]


def render_chat(messages: list[dict[str, Any]], tokenizer: Any) -> list[int]:
    """Template and tokenise (slow for long conversations: the server runs it on a worker thread)."""
    try:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except Exception as exc:  # a template may raise on roles it does not know
        raise ApiError(400, f"the chat template refused these messages: {exc}", "messages") from None
    return list(ids)


def check_prompt(ids: list[int], limits: Limits, field: str) -> None:
    if not ids:
        raise ApiError(400, "the prompt is empty", field)
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is outside the vocabulary (size {limits.vocab_size})", field)
    if limits.max_model_len is not None and len(ids) >= limits.max_model_len:
        raise ApiError(
            400,
            f"the prompt has {len(ids)} tokens; this model's context is {limits.max_model_len} tokens",
            field,
        )
    if len(ids) > limits.kv_tokens:
        raise ApiError(
            400, f"the prompt has {len(ids)} tokens; the KV cache holds {limits.kv_tokens} in all", field
        )


def max_new_tokens(requested: int | None, prompt_len: int, limits: Limits, field: str) -> int:
    """``requested`` if it can fit; by default whatever room the context and the KV cache leave.

    The room is the engine's own rule (:func:`cbcore.scheduling.request.max_new_tokens_limit`), so the
    server never accepts what the engine would refuse, nor refuses what it would run.
    """
    room = max_new_tokens_limit(prompt_len, limits.max_model_len, limits.kv_tokens)
    if requested is None:
        return max(room, 1)
    if requested > room:
        raise ApiError(
            400,
            f"{field}={requested} plus the prompt's {prompt_len} tokens can never fit: the model's context "
            f"is {limits.max_model_len} tokens and the KV cache holds {limits.kv_tokens}",
            field,
        )
    return requested


def sampling_params(body: CompletionRequest | ChatRequest, max_tokens: int) -> SamplingParams:
    greedy = body.temperature < GREEDY_BELOW  # top_p and top_k mean nothing then (OpenAI and vLLM accept them)
    values = {
        "max_new_tokens": max_tokens,
        "temperature": body.temperature,
        "top_p": 1.0 if greedy else body.top_p,
        "top_k": 0 if greedy else max(body.top_k, 0),
        "seed": body.seed,
        "ignore_eos": body.ignore_eos,
    }
    try:
        return SamplingParams(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        field = str(err["loc"][0]) if err["loc"] else "temperature"
        raise ApiError(400, msg, {"max_new_tokens": "max_tokens"}.get(field, field)) from None
