"""The prompt checks of `cb serve` at their edges: an empty prompt, the first and last token ids, no room left.

In process (ASGI), on the servers of ``test_serve_limits_boundaries``.
"""

from __future__ import annotations

import pytest
from test_serve_limits_boundaries import CONTEXT, KV_TOKENS, by_context, by_kv, refused, served, tokenizer

from cbcore.serve.convert import Limits, max_new_tokens

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
    for first, second in ((vocab, -1), (-1, vocab)):  # the first one outside is named, whichever end it is at
        message = refused(ids(by_context, [5, first, 6, second]), "prompt")
        assert f"token id {first} is outside the vocabulary" in message


@pytest.mark.parametrize(
    ("prompt_len", "max_model_len", "kv_tokens", "room"),
    [(10, 48, 1000, 38), (10, 48, 20, 11), (10, None, 20, 11), (48, 48, 1000, 1), (30, None, 20, 1)],
)
def test_without_max_tokens_a_request_may_generate_the_room_left_and_never_fewer_than_one(
    prompt_len, max_model_len, kv_tokens, room
) -> None:
    """The context holds prompt + output; the KV cache all but the last generated token. A prompt that
    leaves no room (refused before this, by check_prompt) still gets a default of one token, never zero."""
    limits = Limits(vocab_size=100, max_model_len=max_model_len, kv_tokens=kv_tokens)
    assert max_new_tokens(None, prompt_len, limits, "max_tokens") == room


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
