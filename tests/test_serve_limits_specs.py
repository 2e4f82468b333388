"""The prompt checks of `cb serve` at their edges: an empty prompt, the first and last token ids, no room left.

In process (ASGI), on the servers of ``test_serve_limits_boundaries``.
"""

from __future__ import annotations

import pytest
from test_serve_limits_boundaries import CONTEXT, KV_TOKENS, by_context, by_kv, refused, served, tokenizer

__all__ = ["by_context", "by_kv", "tokenizer"]  # fixtures, shared with the boundary tests


def ids(client, prompt: list[int]):
    return client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})


def test_an_empty_prompt_is_refused_as_a_bad_request(by_context) -> None:
    assert "the prompt is empty" in refused(by_context.post(
        "/v1/completions", json={"model": "tiny", "prompt": [], "max_tokens": 1}), "prompt")


def test_token_ids_from_zero_to_the_last_of_the_vocabulary_are_taken_and_no_others(by_context, models) -> None:
    vocab = models["llama"].config.vocab_size
    served(ids(by_context, [0, vocab - 1]), 1)
    for bad in (vocab, -1):
        message = refused(ids(by_context, [5, bad]), "prompt")
        assert f"token id {bad} is outside the vocabulary (size {vocab})" in message


@pytest.mark.parametrize(("server", "room"), [("by_context", CONTEXT - 1), ("by_kv", KV_TOKENS)])
def test_a_chat_without_max_tokens_whose_prompt_leaves_no_room_still_gets_one_token(server, room, request, tokenizer):
    """No room for a generated token's KV: the last prompt position's logits still give one token."""
    client = request.getfixturevalue(server)
    messages = next(m for k in range(1, 200) if len(chat_ids(tokenizer, m := [{"role": "user", "content": "a " * k}])) == room)
    body = {"model": "tiny", "messages": messages, "ignore_eos": True}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (room, 1)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
