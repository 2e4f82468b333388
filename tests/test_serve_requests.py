"""`cb serve` on odd but legal requests and on clients that hang up: each answer as OpenAI would give it.

* A lone surrogate in a prompt or a chat message is a 400 naming the field.
* A non-streamed request whose client hangs up is aborted quietly (no
  traceback in the log).
* ``stop`` is capped (the cap in the error), and at the cap it still works.
* A length cut inside a multi-byte character ends the text before it.
* temperature 0 with top_p is greedy; a text part without ``text``, a 405,
  ``max_tokens: null`` and ``stream_options`` without ``stream`` answer as
  OpenAI's API does.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from support import SERVE_KEY
from support.serve_client import long_context_model_dir
from test_serve_load import metric
from transformers import AutoModelForCausalLM, AutoTokenizer

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.serve.launch import ServerProcess
from cbcore.serve.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS

AUTH = {"Authorization": f"Bearer {SERVE_KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url + "/v1", headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model_name(http) -> str:
    return http.get("models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=SERVE_KEY, max_retries=0)


def refusal(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_a_lone_surrogate_is_a_400_naming_the_field(http, model_name):
    # json.dumps escapes a lone surrogate as \ud800, as a JavaScript client's JSON.stringify does.
    body = json.dumps({"model": model_name, "prompt": "ab\ud800cd", "max_tokens": 2})
    error = refusal(http.post("completions", content=body))
    assert error["param"] == "prompt" and error["type"] == "invalid_request_error"
    assert "lone surrogate U+D800 at character 2" in error["message"]
    body = json.dumps({"model": model_name, "messages": [{"role": "user", "content": "x\udfffy"}]})
    error = refusal(http.post("chat/completions", content=body))
    assert error["param"] == "messages" and "lone surrogate U+DFFF at character 1" in error["message"]
    body = json.dumps({"model": model_name, "prompt": "hi", "stop": ["\ud83d"]})
    assert refusal(http.post("completions", content=body))["param"] == "stop"
    pair = json.dumps({"model": model_name, "prompt": "ok \U0001f600", "max_tokens": 2})  # a real pair: fine
    assert "\\ud83d\\ude00" in pair and http.post("completions", content=pair).status_code == 200


@pytest.fixture(scope="module")
def long_context_server(tmp_path_factory):
    """`cb serve` on the tiny model given 16k positions: a request that outlasts any disconnect poll.

    (At the tiny model's 512 positions a whole request takes under a second on a fast machine, so
    it could end normally before its handler looks for the disconnect.)"""
    args = [
        "--model",
        str(long_context_model_dir(tmp_path_factory)),
        "--api-key",
        SERVE_KEY,
        "--threads",
        "1",
        "--set",
        "kv_cache.num_blocks=4200",
    ]
    with ServerProcess(args, env={"OMP_NUM_THREADS": "1"}) as server:
        yield server


def test_a_client_hanging_up_on_a_plain_request_is_aborted_without_a_traceback(long_context_server):
    server = long_context_server
    start = len(server.log_text())
    model = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]["id"]
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 16000, "ignore_eos": True}
    for _ in range(4):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=0.3)
    deadline = time.monotonic() + 60
    while True:  # each is aborted once its handler sees the disconnect (polled every 0.5 s)
        text = httpx.get(server.url + "/metrics").text
        aborts = metric(text, 'cbcore:request_success_total{finished_reason="abort"', 0)
        if aborts >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert aborts == 4 and metric(text, 'cbcore:request_success_total{finished_reason="length"', 0) == 0
    log = server.log_text()[start:]
    assert "Traceback" not in log and "InvalidStateError" not in log, log[-3000:]


def test_stop_is_capped_and_works_at_the_cap(http, model_name, client):
    base = {"model": model_name, "prompt": "the capital of France is", "max_tokens": 24, "temperature": 0}
    error = refusal(
        http.post("completions", json={**base, "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]})
    )
    assert error["param"] == "stop" and f"at most {MAX_STOP_STRINGS}" in error["message"]
    error = refusal(http.post("completions", json={**base, "stop": ["x" * (MAX_STOP_CHARS + 1)]}))
    assert error["param"] == "stop" and f"at most {MAX_STOP_CHARS}" in error["message"]
    full = client.completions.create(**base).choices[0].text
    assert len(full) > 4
    at_cap = [f"never-{i}-" + "z" * (MAX_STOP_CHARS - 12) for i in range(MAX_STOP_STRINGS - 1)] + [full[2:4]]
    cut = client.completions.create(**base, stop=at_cap).choices[0]
    assert (cut.text, cut.finish_reason) == (full[: full.index(full[2:4])], "stop")


def test_a_length_cut_inside_a_character_ends_the_text_before_it(
    tiny_server, cb_tiny_model_dir, client, model_name
):
    tok = AutoTokenizer.from_pretrained(cb_tiny_model_dir)
    engine = Engine(AutoModelForCausalLM.from_pretrained(cb_tiny_model_dir), None, EngineConfig())
    prompts = [tok.encode(w) for w in ("🙂 🎉", "東京 日本語", "café crème", "résumé Zürich", "the capital")]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True))
    cases = [
        (p, o.output_token_ids[:k])
        for p, o in zip(prompts, outs, strict=True)
        for k in range(2, 64)
        if tok.decode(o.output_token_ids[:k]).endswith("\ufffd")
    ]
    assert cases, "the tiny model never stopped mid-character in these outputs"
    for prompt, tokens in cases[:3]:
        want = tok.decode(tokens).rstrip("\ufffd")
        kwargs = {"model": model_name, "prompt": prompt, "max_tokens": len(tokens), "temperature": 0}
        resp = client.completions.create(**kwargs, extra_body={"ignore_eos": True, "return_token_ids": True})
        choice = resp.choices[0]
        assert (choice.text, choice.token_ids, choice.finish_reason) == (want, tokens, "length")
        assert resp.usage.completion_tokens == len(tokens)
        streamed = client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in streamed) == want


def test_the_smaller_answers_match_openai(tiny_server, http, model_name, client):
    base = {"model": model_name, "prompt": "the capital of France is", "max_tokens": 12}
    greedy = client.completions.create(**base, temperature=0).choices[0].text
    assert client.completions.create(**base, temperature=0, top_p=0.9).choices[0].text == greedy
    chat = {"model": model_name, "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    error = refusal(http.post("chat/completions", json=chat))
    assert (
        error["param"] == "messages"
        and "content[0]: a 'text' part needs a string field 'text'" in error["message"]
    )
    error = refusal(http.get("completions"), 405)
    assert (
        error["type"] == "invalid_request_error"
        and error["message"] == "GET is not allowed on /v1/completions; use POST"
    )
    error = refusal(http.get("nowhere"), 404)
    assert error["type"] == "not_found_error" and "/v1/nowhere" in error["message"]
    resp = http.post("completions", json={**base, "max_tokens": None, "ignore_eos": True}).json()
    assert resp["usage"]["completion_tokens"] == 16  # null is OpenAI's default, 16
    error = refusal(http.post("completions", json={**base, "stream_options": {"include_usage": True}}))
    assert error["param"] == "stream_options" and "only allowed when stream is true" in error["message"]
    stream = http.post(
        "completions", json={**base, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
