"""The adapter in vLLM's OpenAI-compatible server, as a user starts it.

One server on the default model (SmolLM2-135M, converted once by cbcore) for
the token and per-request-field checks, and one start that must fail.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import SERVER_SCHED as SCHED
from vllm_helpers import STARTED_EARLY, stop_servers, wait_healthy

# Every test here starts vLLM (from .venv-vllm, `make vllm-setup`); they run in CI.
pytestmark = pytest.mark.vllm

PROMPTS = ["The capital of France is", "Once upon a time", "In machine learning, a transformer is"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def default_dir() -> Path:
    from cbcore.models.default_model import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="module")
def adapter_servers(vllm_servers: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The session's two servers (started with the session, vllm_helpers.vllm_starts_early), stopped when
    this module is done, so that they hold no memory while the rest of the suite runs."""
    assert "vllm_servers" in STARTED_EARLY
    yield vllm_servers
    stop_servers(vllm_servers)


@pytest.fixture(scope="module")
def server(adapter_servers: dict[str, Any]) -> dict[str, Any]:
    started = adapter_servers["default"]
    wait_healthy(started.proc, adapter_servers["port"], started.log)
    sys.stderr.write(f"vLLM server (default model) healthy {time.monotonic() - started.t0:.1f} s after it started\n")
    return {"port": adapter_servers["port"], "events": adapter_servers["events"]}


def complete(port: int, **body: Any) -> dict[str, Any]:
    import urllib.request

    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps({"model": "smollm", "temperature": 0, **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def post(port: int, **body: Any) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON body), errors included."""
    import urllib.error

    try:
        return 200, complete(port, **body)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_bad_vllm_xargs_get_a_400_naming_the_field_and_the_others_are_served(server: dict[str, Any]) -> None:
    """docs/vllm.md, "Per-request fields": cbcore_vllm.RequestCheck answers before vLLM's engine sees it."""
    bad = {"deadline_s": -1}, {"attrs": "{not json"}, {"client_id": ""}
    with ThreadPoolExecutor(len(bad) + 2) as pool:
        refused = [pool.submit(post, server["port"], prompt="Hello", max_tokens=4, vllm_xargs=x) for x in bad]
        served = [pool.submit(post, server["port"], prompt=p, max_tokens=4) for p in PROMPTS[:2]]
        answers = [f.result() for f in refused], [f.result() for f in served]
    for status, body in answers[0]:
        assert status == 400 and body["error"]["type"] == "BadRequestError" and body["error"]["param"] == "vllm_xargs"
    messages = [body["error"]["message"] for _, body in answers[0]]
    assert messages[0] == "vllm_xargs: deadline_s must be finite and > 0, got -1"
    assert messages[1].startswith("vllm_xargs: attrs must be a JSON object (or its JSON text), got unparsable text")
    assert messages[2].startswith("vllm_xargs: client_id")
    assert [(status, body["choices"][0]["finish_reason"]) for status, body in answers[1]] == [(200, "length")] * 2
    # vLLM's engine lives on: the next request is served.
    assert post(server["port"], prompt="Once more", max_tokens=2)[0] == 200


def test_greedy_tokens_equal_cbcore_engine(server: dict[str, Any], default_dir: Path) -> None:
    from transformers import AutoTokenizer

    from cbcore import Engine, EngineConfig, SamplingParams

    tok = AutoTokenizer.from_pretrained(default_dir)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    # Sent at once, so that vLLM batches them (and chunks their prefills) under the adapter.
    with ThreadPoolExecutor(len(ids)) as pool:
        answers = list(
            pool.map(lambda i: complete(server["port"], prompt=i, max_tokens=MAX_TOKENS, return_token_ids=True), ids)
        )
    got = [a["choices"][0]["token_ids"] for a in answers]
    config = EngineConfig.model_validate({"scheduler": SCHED, "kv_cache": {"block_size": 32, "num_blocks": 256}})
    engine = Engine.from_pretrained(str(default_dir), config=config)
    ref = engine.generate(ids, SamplingParams(max_new_tokens=MAX_TOKENS))
    assert got == [list(o.output_token_ids) for o in ref]
    assert tok.decode(got[0]).startswith(" Paris")


def test_client_id_deadline_and_attrs_reach_the_policy(server: dict[str, Any]) -> None:
    xargs = {"client_id": "tenant-7", "deadline_s": 2.5, "attrs": json.dumps({"tier": "gold", "n": [1, 2]})}
    complete(server["port"], prompt="Hello there", max_tokens=2, priority=3, vllm_xargs=xargs)
    deadline = time.monotonic() + 30
    seen: list[dict[str, Any]] = []
    while time.monotonic() < deadline and not seen:
        lines = server["events"].read_text().splitlines() if server["events"].exists() else []
        seen = [e for e in map(json.loads, lines) if e["event"] == "arrival" and e["client_id"] == "tenant-7"]
        time.sleep(0.2)
    assert seen, "the policy never saw the request"
    e = seen[0]
    assert (e["deadline_s"], e["priority"], e["attrs"]) == (2.5, 3, {"tier": "gold", "n": [1, 2]})
    assert e["deadline"] == pytest.approx(e["arrival_time"] + 2.5)
    assert e["max_new_tokens"] == 2


def test_unknown_plugin_stops_the_server_naming_it(adapter_servers: dict[str, Any]) -> None:
    started = adapter_servers["unknown-plugin"]  # config {"scheduler": {"queue": {"name": "priorty"}}}
    out = started.wait(900)
    sys.stderr.write(f"vLLM server with an unknown plugin exited {time.monotonic() - started.t0:.1f} s after it started\n")
    assert started.proc.returncode != 0
    assert "scheduler.queue: unknown queue plugin 'priorty' (did you mean 'priority'?)" in out, out[-3000:]


def test_cb_bench_drives_vllm_with_the_same_trace_and_fields(server: dict[str, Any]) -> None:
    """`cb bench --server URL` speaks vLLM's dialect: priority, and the rest in vllm_xargs, per class."""
    from cbcore.bench.http_driver import run_http
    from cbcore.bench.workload import BenchRequest, Workload

    reqs = tuple(
        BenchRequest(request_id=f"bench-{i}", arrival_s=0.05 * i, max_new_tokens=4, prompt_token_ids=tuple(range(20 + i, 40 + i)), ignore_eos=True,
                     priority=i % 2, client_id=f"bench-{'ab'[i % 2]}", deadline_s=30.0 + i, attrs={"i": i})
        for i in range(6)
    )  # fmt: skip
    workload = Workload("vllm-bench", reqs)
    run = run_http(f"http://127.0.0.1:{server['port']}", "vllm", workload, [r.prompt_token_ids for r in reqs])
    assert run.info["dialect"] == "vllm" and run.info["prefix_cache_kept"] is None  # emptied (its development mode)
    assert [o.finish_reason for o in run.outputs] == ["length"] * 6
    assert all(len(o.output_token_ids) == 4 and o.metrics.ttft is not None for o in run.outputs)
    deadline = time.monotonic() + 30
    seen: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline and len(seen) < 6:
        lines = server["events"].read_text().splitlines() if server["events"].exists() else []
        seen = {e["client_id"] + str(e["deadline_s"]): e for e in map(json.loads, lines)
                if e["event"] == "arrival" and str(e["client_id"]).startswith("bench-")}  # fmt: skip
        time.sleep(0.2)
    for i, req in enumerate(reqs):
        e = seen[f"{req.client_id}{req.deadline_s}"]
        assert (e["priority"], e["attrs"], e["max_new_tokens"]) == (i % 2, {"i": i}, 4)
