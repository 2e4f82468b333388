"""Every request limit of `cb serve` at its exact boundary: the last value accepted, the first refused.

The application runs in this process (ASGI, through starlette's TestClient,
which also runs its lifespan and so the engine thread), built the way
``cb serve`` builds it, on a tiny model with a small context, a small KV
cache and a small body limit, so that each limit can be reached exactly.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from cbcore import Engine, EngineConfig
from cbcore.serve.app import build_app
from cbcore.serve.config import ServeConfig
from cbcore.serve.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS
from cbcore.testing.tiny_tokenizer import tiny_tokenizer

CONTEXT = 48  # model.max_model_len of the context-bound server
KV_TOKENS = 32  # 8 blocks of 4: the KV-bound server's whole cache (its context is the model's 512)
BODY_LIMIT = 2048


def serve(tiny_model, tokenizer, max_waiting: int = 1024, **engine: object) -> Iterator[TestClient]:
    config = EngineConfig.model_validate({"backend": {"name": "eager"}, **engine})
    settings = ServeConfig(max_body_bytes=BODY_LIMIT, max_waiting=max_waiting)
    app = build_app(Engine(tiny_model, config=config), tokenizer, "tiny", settings)
    with TestClient(app) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def by_context(models, tokenizer) -> Iterator[TestClient]:
    yield from serve(models["llama"], tokenizer, model={"max_model_len": CONTEXT})


@pytest.fixture(scope="module")
def by_kv(models, tokenizer) -> Iterator[TestClient]:
    yield from serve(models["llama"], tokenizer, kv_cache={"block_size": 4, "num_blocks": KV_TOKENS // 4})


def complete(client: TestClient, n_prompt: int, max_tokens: int | None = 1, **extra: object):
    body = {
        "model": "tiny",
        "prompt": [5 + i % 50 for i in range(n_prompt)],
        "max_tokens": max_tokens,
        **extra,
    }
    return client.post("/v1/completions", json=body)


def refused(response, field: str, status: int = 400) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == field, error
    return error["message"]


def served(response, completion_tokens: int) -> None:
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == completion_tokens


def test_a_prompt_as_long_as_the_context_is_refused_and_one_token_shorter_is_served(by_context):
    assert "this model's context is 48 tokens" in refused(complete(by_context, CONTEXT), "prompt")
    served(complete(by_context, CONTEXT - 1), 1)


def test_prompt_plus_max_tokens_may_fill_the_context_exactly_and_not_one_token_more(by_context):
    served(complete(by_context, 40, max_tokens=CONTEXT - 40), CONTEXT - 40)
    assert "can never fit" in refused(complete(by_context, 40, max_tokens=CONTEXT - 40 + 1), "max_tokens")
    chat_field = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10_000}
    response = by_context.post("/v1/chat/completions", json={"model": "tiny", **chat_field})
    refused(response, "max_completion_tokens")


def test_a_chat_without_max_tokens_gets_the_rest_of_the_context(by_context):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    response = by_context.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT


def test_a_prompt_filling_the_kv_cache_is_served_and_one_token_more_is_refused(by_kv):
    served(complete(by_kv, KV_TOKENS), 1)
    assert "the KV cache holds 32" in refused(complete(by_kv, KV_TOKENS + 1), "prompt")


def test_prompt_plus_max_tokens_may_need_the_whole_kv_cache_and_not_one_slot_more(by_kv):
    """The last generated token is never fed back, so it needs no KV slot: 30 + 3 tokens fit 32 slots."""
    served(complete(by_kv, 30, max_tokens=3, ignore_eos=True), 3)
    refused(complete(by_kv, 30, max_tokens=4), "max_tokens")


def body_of(size: int) -> bytes:
    """A valid completions body of exactly ``size`` bytes (JSON padded with spaces)."""
    body = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1}).encode()
    assert len(body) <= size
    return body[:-1] + b" " * (size - len(body)) + b"}"


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_exactly_at_the_byte_limit_is_served_and_one_byte_more_is_413(by_context, chunked):
    headers = {"content-type": "application/json"}

    def post(body: bytes):
        if chunked:  # no Content-Length: the limit is enforced while the body is read
            pieces = (body[i : i + 500] for i in range(0, len(body), 500))
            return by_context.post("/v1/completions", content=pieces, headers=headers)
        return by_context.post("/v1/completions", content=body, headers=headers)

    served(post(body_of(BODY_LIMIT)), 1)
    response = post(body_of(BODY_LIMIT + 1))
    assert response.status_code == 413, response.text
    message = response.json()["error"]["message"]
    assert f"at most {BODY_LIMIT} bytes" in message
    # A declared length is refused from the header, before a byte is read; a chunked body while it is read.
    assert (
        f"passed {BODY_LIMIT} bytes" if chunked else f"Content-Length is {BODY_LIMIT + 1} bytes"
    ) in message


def test_stop_strings_are_taken_up_to_their_count_and_length_limits(by_context):
    served(complete(by_context, 4, stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)]), 1)
    assert "at most 32" in refused(
        complete(by_context, 4, stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), "stop"
    )
    served(complete(by_context, 4, stop=["x" * MAX_STOP_CHARS]), 1)
    assert "at most 256" in refused(complete(by_context, 4, stop=["x" * (MAX_STOP_CHARS + 1)]), "stop")


def test_a_prompt_text_longer_than_the_context_could_hold_is_refused_by_its_characters(by_context, tokenizer):
    """No token spells more than the vocabulary's longest entry: at most CONTEXT x that many characters fit."""
    most = CONTEXT * max(len(token) for token in tokenizer.get_vocab())
    body = {"model": "tiny", "max_tokens": 1}
    message = refused(by_context.post("/v1/completions", json={**body, "prompt": "a" * (most + 1)}), "prompt")
    assert f"{most + 1} characters; at most {most}" in message
    message = refused(by_context.post("/v1/completions", json={**body, "prompt": "a" * most}), "prompt")
    assert "characters" not in message and "tokens" in message  # past the character check: counted in tokens


def test_the_server_is_full_when_max_waiting_requests_wait_and_not_before(models, tokenizer):
    """With max_waiting=3: a request finding 3 waiting gets 503 with Retry-After; finding 2, it is served.

    The engine thread is idle before the first request, so the waiting count it reported last is
    the one the handler reads; the test sets that report.
    """
    for client in serve(models["llama"], tokenizer, max_waiting=3):
        loop = client.app.state.cb.loop
        loop.load = dataclasses.replace(loop.load, num_waiting=3)
        response = complete(client, 4)
        assert response.status_code == 503 and response.headers["retry-after"] == "1", response.text
        assert "3 requests are already waiting" in response.json()["error"]["message"]
        loop.load = dataclasses.replace(loop.load, num_waiting=2)
        served(complete(client, 4), 1)


def test_a_chat_needs_at_least_one_message(by_context):
    body = {"model": "tiny", "max_completion_tokens": 1}
    refused(by_context.post("/v1/chat/completions", json={**body, "messages": []}), "messages")
    served(
        by_context.post(
            "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}]}
        ),
        1,
    )
