"""Request bodies `cb serve` refuses as a whole, as the official `openai` client sees them.

* JSON nested deeper than 64 levels (``attrs`` 900 deep in a 2 KB body once
  gave a 500 and 200 KB of traceback) is a 400 naming the path, before the
  body is parsed: nothing is logged, and the server goes on serving; 63
  levels of ``attrs`` still pass.
* Fields accepted only at their neutral value (``n``, penalties, tools,
  ``tool_choice``, ``response_format``, ...) set otherwise are refused in one
  400 that names every one of them; at their neutral values they pass.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from support import SERVE_KEY
from test_request_attrs import nested

from cbcore.serve.nesting import MAX_JSON_DEPTH

AUTH = {"Authorization": f"Bearer {SERVE_KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=SERVE_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


def test_deep_attrs_are_a_400_naming_the_path_with_nothing_logged(tiny_server, client, model_name):
    log_before = len(tiny_server.log_text())
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="hi", max_tokens=1, extra_body={"attrs": nested(100, "a")})
    error = info.value.body
    assert info.value.status_code == 400 and error["param"] == "attrs"
    assert error["message"] == f"attrs{'.a' * 63}: JSON nested deeper than {MAX_JSON_DEPTH} levels (the most this server takes)"
    # 900 levels in under 2 KB, as sent by hand (json.dumps itself recurses): the same answer.
    body = b'{"model": "%s", "prompt": "hi", "attrs": ' % model_name.encode() + b'{"a":' * 900 + b"1" + b"}" * 901
    assert len(body) < 6000
    r = httpx.post(tiny_server.url + "/v1/completions", content=body, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "attrs", r.text
    assert "nested deeper than 64 levels" in r.json()["error"]["message"]
    # Anywhere in the body, and an array at the top names no field.
    chat = b'{"model": "m", "messages": [{"role": "user", "content": "x", "name": ' + b"[" * 80 + b"]" * 80 + b"}]}"
    r = httpx.post(tiny_server.url + "/v1/chat/completions", content=chat, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages[0].name" + "[0]" * 61)
    r = httpx.post(tiny_server.url + "/v1/completions", content=b"[" * 5000 + b"]" * 5000, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    new_log = tiny_server.log_text()[log_before:]
    assert "Traceback" not in new_log and "RecursionError" not in new_log, new_log[-3000:]
    # The limit itself passes (attrs 63 deep, the body 64), and the server serves on.
    out = client.completions.create(model=model_name, prompt="hi", max_tokens=2, extra_body={"attrs": nested(63, "a")})
    assert out.choices[0].finish_reason == "length"


def test_neutral_only_fields_set_otherwise_are_all_named_in_one_400(client, model_name):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model_name,
            messages=messages,
            n=2,
            tool_choice="required",
            response_format={"type": "text", "strict": True},
            presence_penalty=0.5,
        )
    error = info.value.body
    assert error["param"] == "n" and error["type"] == "invalid_request_error"
    assert error["message"] == (
        'n=2 (neutral: 1), presence_penalty=0.5 (neutral: 0), tool_choice="required" (neutral: null or "none"), '
        'response_format={"type": "text", "strict": true} (neutral: {"type": "text"}): these fields are not '
        "supported by this server, which accepts them only at their neutral values"
    )
    with pytest.raises(openai.BadRequestError, match=r"^Error code: 400 .*echo=true \(neutral: false\), best_of=2"):
        client.completions.create(model=model_name, prompt="hi", echo=True, best_of=2, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match=r"tool_choice=\{\"type\": \"function\""):
        client.chat.completions.create(
            model=model_name, messages=messages, tool_choice={"type": "function", "function": {"name": "f"}}
        )
    # The neutral values themselves are accepted.
    out = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=2,
        n=1,
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
        frequency_penalty=0,
        logprobs=False,
    )
    assert out.choices[0].finish_reason == "length"
    out = client.completions.create(model=model_name, prompt="hi", max_tokens=2, echo=False, best_of=1, suffix="")
    assert out.choices[0].finish_reason == "length"
