"""`cb serve` through the official `openai` client (sync and async) and httpx, against a real subprocess.

Every output is compared token for token with ``Engine.generate`` on the same
prompts and with HF ``generate`` on each prompt alone (greedy, fp32).
"""

from __future__ import annotations

import asyncio
import itertools

import httpx
import openai
import pytest
from support import SERVE_KEY
from transformers import AutoModelForCausalLM, AutoTokenizer

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.testing import assert_equivalent, compare_greedy, reference_generate

PROMPTS = [
    "the capital of France is",
    "café crème brûlée naïve",
    "東京 日本語 テキスト",
    "quantum computing differs from classical because",
    "🙂 🎉 résumé Zürich",
]
CAPS = [24, 9, 17, 1, 30]
IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def tok(cb_tiny_model_dir):
    return AutoTokenizer.from_pretrained(cb_tiny_model_dir)


@pytest.fixture(scope="module")
def expected(cb_tiny_model_dir, tok):
    """Per (prompt ids): Engine.generate's tokens, checked equal to HF generate per prompt."""
    model = AutoModelForCausalLM.from_pretrained(cb_tiny_model_dir)
    engine = Engine(model, None, EngineConfig.from_dict({"kv_cache": {"num_blocks": 256}}))

    def run(prompt_ids: list[list[int]], caps: list[int]) -> list[list[int]]:
        outs = engine.generate(prompt_ids, [SamplingParams(max_new_tokens=c) for c in caps])
        assert_equivalent(compare_greedy(model, outs, reference_generate(model, prompt_ids, caps)))
        return [o.output_token_ids for o in outs]

    return run


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=SERVE_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def text_of(tok, tokens: list[int]) -> str:
    """The text the server sends for ``tokens``: their decoding, less a character cut off at the end."""
    return tok.decode(tokens, skip_special_tokens=True).rstrip("\ufffd")


def chat_ids(tok, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return list(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def test_completions_equal_the_engine_and_hf_streamed_or_not(client, model_name, tok, expected):
    want = expected([tok.encode(p) for p in PROMPTS], CAPS)
    for prompt, cap, tokens in zip(PROMPTS, CAPS, want, strict=True):
        resp = client.completions.create(
            model=model_name, prompt=prompt, max_tokens=cap, temperature=0, extra_body=IDS
        )
        choice = resp.choices[0]
        assert choice.token_ids == tokens
        assert choice.text == text_of(tok, tokens)
        assert choice.finish_reason == ("stop" if tokens[-1] == tok.eos_token_id else "length")
        assert resp.usage.prompt_tokens == len(tok.encode(prompt))
        assert resp.usage.completion_tokens == len(tokens)
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + len(tokens)

        stream = client.completions.create(
            model=model_name,
            prompt=prompt,
            max_tokens=cap,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body=IDS,
        )
        chunks = list(stream)
        assert [c.usage.completion_tokens for c in chunks[:-1]] == list(
            itertools.accumulate(len(c.choices[0].token_ids) for c in chunks[:-1])
        )
        assert chunks[-1].choices == [] and chunks[-1].usage == resp.usage
        body = [c.choices[0] for c in chunks[:-1]]
        assert [t for c in body for t in c.token_ids] == tokens
        assert "".join(c.text for c in body) == choice.text
        assert [c.finish_reason for c in body] == [None] * (len(body) - 1) + [choice.finish_reason]


def test_token_id_prompts_are_taken_as_they_are(client, model_name, tok, expected):
    ids = tok.encode(PROMPTS[0])
    (tokens,) = expected([ids], [8])
    resp = client.completions.create(
        model=model_name, prompt=ids, max_tokens=8, temperature=0, extra_body=IDS
    )
    assert resp.choices[0].token_ids == tokens and resp.choices[0].prompt_token_ids == ids


def test_chat_equal_the_engine_and_hf_sync_and_async(tiny_server, client, model_name, tok, expected):
    want = expected([chat_ids(tok, p) for p in PROMPTS], CAPS)
    for prompt, cap, tokens in zip(PROMPTS, CAPS, want, strict=True):
        resp = client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": prompt}],
            max_completion_tokens=cap,
            temperature=0,
            extra_body=IDS,
        )
        assert resp.choices[0].token_ids == tokens
        assert resp.choices[0].message.role == "assistant"
        assert resp.choices[0].message.content == text_of(tok, tokens)
        assert resp.usage.prompt_tokens == len(chat_ids(tok, prompt))
        assert resp.usage.completion_tokens == len(tokens)

    async def one(aclient: openai.AsyncOpenAI, prompt: str, cap: int) -> tuple[str, list[int], str | None]:
        stream = await aclient.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=cap,
            temperature=0,
            stream=True,
            extra_body=IDS,
        )
        text, ids, finish, roles = "", [], None, []
        async for chunk in stream:
            delta = chunk.choices[0].delta
            roles.append(delta.role)
            text += delta.content or ""
            ids.extend(getattr(chunk.choices[0], "token_ids", None) or [])
            finish = chunk.choices[0].finish_reason or finish
        assert roles[0] == "assistant" and set(roles[1:]) <= {None}
        return text, ids, finish

    async def all_at_once() -> list[tuple[str, list[int], str | None]]:
        async with openai.AsyncOpenAI(
            base_url=tiny_server.url + "/v1", api_key=SERVE_KEY, max_retries=0
        ) as ac:
            return await asyncio.gather(*(one(ac, p, c) for p, c in zip(PROMPTS, CAPS, strict=True)))

    for (text, ids, finish), tokens in zip(asyncio.run(all_at_once()), want, strict=True):
        assert ids == tokens
        assert text == text_of(tok, tokens)
        assert finish in ("stop", "length")


def _boundary_stop(tok, tokens: list[int]) -> tuple[str, int]:
    """A 3-character stop string that starts one character before a token boundary, and where."""
    text = tok.decode(tokens, skip_special_tokens=True)
    for i in range(2, len(tokens) - 1):
        head = tok.decode(tokens[:i], skip_special_tokens=True)
        b = len(head)
        stop = text[b - 1 : b + 2]
        if text.startswith(head) and len(stop) == 3 and "\ufffd" not in stop and text.find(stop) == b - 1:
            return stop, b - 1
    raise AssertionError(f"no usable token boundary in {text!r}")


def test_stop_strings_match_decoded_text_and_are_never_emitted(client, model_name, tok):
    prompt = PROMPTS[0]
    full = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=24, temperature=0, extra_body=IDS
    )
    tokens = full.choices[0].token_ids
    stop, at = _boundary_stop(tok, tokens)
    text = full.choices[0].text
    resp = client.completions.create(
        model=model_name,
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        stop=[stop, "never-seen"],
        extra_body=IDS,
    )
    choice = resp.choices[0]
    assert (choice.text, choice.finish_reason) == (text[:at], "stop")
    assert tokens[: len(choice.token_ids)] == choice.token_ids  # tokens up to the one completing the stop
    assert stop in tok.decode(choice.token_ids) and stop not in tok.decode(choice.token_ids[:-1])
    assert resp.usage.completion_tokens == len(choice.token_ids) < len(tokens)

    stream = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True
    )
    chunks = [c.choices[0] for c in stream]
    assert "".join(c.text for c in chunks) == text[:at]
    assert chunks[-1].finish_reason == "stop"

    chat = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=24,
        temperature=0,
        extra_body=IDS,
    )
    ctext = chat.choices[0].message.content
    cstop, cat = _boundary_stop(tok, chat.choices[0].token_ids)
    again = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=24,
        temperature=0,
        stop=cstop,
    )
    assert (again.choices[0].message.content, again.choices[0].finish_reason) == (ctext[:cat], "stop")


def test_api_key_is_required_on_v1_only(tiny_server, model_name):
    for key in ("wrong", SERVE_KEY + "x", ""):
        bad = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=key or "-", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=model_name, prompt="hi", max_tokens=1)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    r = httpx.post(tiny_server.url + "/v1/completions", json={"model": model_name, "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(tiny_server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(tiny_server.url + "/metrics").status_code == 200


def test_usage_counts_cached_prompt_tokens_and_the_cache_can_be_emptied(tiny_server, client, model_name):
    prompt = list(range(400, 440))  # two full blocks of 16 the prefix cache can hold, then 8 tokens

    def cached() -> int:
        resp = client.completions.create(model=model_name, prompt=prompt, max_tokens=1)
        return resp.usage.prompt_tokens_details.cached_tokens

    assert cached() == 0 and cached() == 32
    reset = tiny_server.url + "/reset_prefix_cache"
    assert httpx.post(reset).status_code == 401  # a control endpoint: the API key, like /v1
    r = httpx.post(reset, headers={"Authorization": f"Bearer {SERVE_KEY}"})
    assert r.status_code == 200 and r.json()["success"] is True and r.json()["freed_blocks"] >= 2
    assert cached() == 0


BAD_COMPLETIONS = [
    ({"foo": 1}, "foo"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 600}, "max_tokens"),  # beyond the tiny model's 512 positions
    ({"n": 2}, "n"),
    ({"logprobs": 1}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 99999]}, "prompt"),
    ({"prompt": "a " * 600}, "prompt"),
    ({"model": "gpt-4"}, "model"),
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"priority": "high"}, "priority"),
    ({"user": ""}, "user"),
    ({"deadline_s": -1}, "deadline_s"),
    ({"attrs": [1, 2]}, "attrs"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
]
BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"logprobs": True}, "logprobs"),
    ({"max_completion_tokens": 600}, "max_completion_tokens"),
]


@pytest.mark.parametrize("stream", [False, True])
def test_each_bad_request_is_a_400_naming_the_field(tiny_server, model_name, stream):
    headers = {"Authorization": f"Bearer {SERVE_KEY}"}
    cases = [("completions", {"model": model_name, "prompt": "hi", **c}, p) for c, p in BAD_COMPLETIONS]
    base = {"model": model_name, "messages": [{"role": "user", "content": "hi"}]}
    cases += [("chat/completions", {**base, **c}, p) for c, p in BAD_CHATS]
    with httpx.Client(base_url=tiny_server.url + "/v1", headers=headers, timeout=30) as http:
        for route, body, param in cases:
            r = http.post(route, json={**body, "stream": stream})
            assert r.status_code == 400, (route, body, r.text)
            error = r.json()["error"]
            assert error["param"] == param, (body, error)
            assert error["type"] == "invalid_request_error" and error["message"]
        r = http.post("completions", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="not served"):
        openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=SERVE_KEY, max_retries=0).completions.create(
            model="nope", prompt="hi"
        )


def test_models_health_and_metrics(tiny_server, client, model_name):
    assert [m.id for m in client.models.list().data] == [model_name]
    text = httpx.get(tiny_server.url + "/metrics").text
    policy = 'policy="fcfs+token-budget+chunked-prefill+recompute"'
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_success_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "request_queue_time_seconds_bucket",
        "iteration_tokens_total_bucket",
    ):
        lines = [line for line in text.splitlines() if line.startswith(f"cbcore:{name}{{")]
        assert lines and all(policy in line for line in lines), name
