"""`cb serve` under load, at its limits and at shutdown, on 127.0.0.1 only.

* 200 concurrent streaming clients, a fifth hanging up mid-stream: everyone
  else gets exactly the engine's tokens; afterwards no KV block is held
  (read from /metrics), /health answers, and the server's RSS grew by less
  than ``RSS_BOUND_MB``.
* A full waiting queue answers 503 with Retry-After; a request the KV cache
  can never hold is a 400; ``priority``, ``user``, ``deadline_s`` and
  ``attrs`` reach the policies.
* SIGTERM in the middle of a load: every stream either completes exactly or
  ends with a clean error event, and the server exits 0.
"""

from __future__ import annotations

import asyncio
import json
import random
import textwrap
import time

import httpx
import openai
import pytest
from support import SERVE_KEY
from transformers import AutoModelForCausalLM, AutoTokenizer

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.serve.launch import ServerProcess

NUM_CLIENTS = 200
HANG_UP_EVERY = 5  # a fifth of the clients disconnect after their second chunk
RSS_BOUND_MB = 64
WORDS = [
    "the",
    "capital",
    "of",
    "France",
    "is",
    "Paris",
    "café",
    "crème",
    "東京",
    "日本語",
    "🙂",
    "model",
    "token",
    "batch",
    "cache",
    "policy",
]


def metric(text: str, prefix: str, default: float | None = None) -> float:
    """The value of the first series whose line starts with ``prefix`` (a name, or a name and labels)."""
    for line in text.splitlines():
        if line.startswith(prefix) and line[len(prefix)] in " {,":
            return float(line.rsplit(" ", 1)[1])
    if default is not None:
        return default
    raise AssertionError(f"{prefix} not in /metrics")


def engine_outputs(
    model_dir, prompts: list[list[int]], caps: list[int], ignore_eos: bool = False
) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    engine = Engine(model, None, EngineConfig.from_dict({"kv_cache": {"num_blocks": 1024}}))
    params = [SamplingParams(max_new_tokens=c, ignore_eos=ignore_eos) for c in caps]
    return [o.output_token_ids for o in engine.generate(prompts, params)]


async def stream_tokens(
    client: openai.AsyncOpenAI, model: str, prompt: list[int], cap: int, hang_up: bool, **extra
):
    """The streamed token ids, or None for a client that hangs up after two chunks."""
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=cap,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True, **extra},
    )
    ids: list[int] = []
    chunks = 0
    async for chunk in stream:
        ids.extend(chunk.choices[0].token_ids or [])
        chunks += 1
        if hang_up and chunks == 2:
            await stream.close()
            return None
    return ids


def test_200_streaming_clients_a_fifth_hanging_up(tiny_server, cb_tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(cb_tiny_model_dir)
    rng = random.Random(0)
    prompts = [tok.encode(" ".join(rng.choices(WORDS, k=rng.randint(2, 12)))) for _ in range(NUM_CLIENTS)]
    caps = [rng.randint(8, 32) for _ in range(NUM_CLIENTS)]
    want = engine_outputs(cb_tiny_model_dir, prompts, caps)
    model = httpx.get(tiny_server.url + "/v1/models", headers={"Authorization": f"Bearer {SERVE_KEY}"}).json()
    name = model["data"][0]["id"]

    async def load(n: int) -> list[list[int] | None]:
        async with openai.AsyncOpenAI(
            base_url=tiny_server.url + "/v1", api_key=SERVE_KEY, max_retries=0
        ) as client:
            jobs = [
                stream_tokens(client, name, prompts[i], caps[i], hang_up=i % HANG_UP_EVERY == 0)
                for i in range(n)
            ]
            return await asyncio.wait_for(asyncio.gather(*jobs), timeout=600)

    asyncio.run(load(40))  # warm-up: first-call costs are not growth
    before = idle_metrics(tiny_server.url)
    got = asyncio.run(load(NUM_CLIENTS))
    for i, ids in enumerate(got):
        if i % HANG_UP_EVERY == 0:
            assert ids is None
        else:
            assert ids == want[i], f"client {i}"
    after = idle_metrics(tiny_server.url)
    assert metric(after, "cbcore:kv_cache_blocks_used") == 0
    assert metric(after, "cbcore:kv_cache_usage_perc") == 0
    assert metric(after, "cbcore:num_requests_running") == metric(after, "cbcore:num_requests_waiting") == 0
    # Each request is counted once: finished by the engine, or aborted when its client left first.
    assert finished(after) - finished(before) == NUM_CLIENTS
    assert metric(after, ABORTED) > metric(before, ABORTED, default=0)
    assert httpx.get(tiny_server.url + "/health").json() == {"status": "ok"}
    rss = "process_resident_memory_bytes"
    grown_mb = (metric(after, rss) - metric(before, rss)) / 2**20
    print(f"server RSS grew by {grown_mb:.1f} MiB under load (bound {RSS_BOUND_MB} MiB)")  # shown with -s
    assert grown_mb < RSS_BOUND_MB, f"RSS grew by {grown_mb:.1f} MiB under load"


ABORTED = 'cbcore:request_success_total{finished_reason="abort"'


def finished(text: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("cbcore:request_success_total{")
    )


def idle_metrics(url: str, timeout_s: float = 30.0) -> str:
    """/metrics once nothing is running or waiting (aborts take effect before the next step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(url + "/metrics").text
        busy = metric(text, "cbcore:num_requests_running") + metric(text, "cbcore:num_requests_waiting")
        if busy == 0 or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


# -- a small server: 2 slots, 8 waiting places, a KV cache smaller than the context --------------

RECORDER = """
    import json
    from pydantic import BaseModel
    from cbcore import QueuePolicy, hookimpl
    from cbcore.bench.workload import thaw

    class Params(BaseModel):
        path: str

    class Recorder(QueuePolicy):
        '''FCFS that writes down the scheduling fields of every arrival.'''
        name = "recorder"
        Params = Params

        def key(self, seq, now):
            return (seq.arrival_time, seq.request_id)

        def on_arrival(self, seq, now):
            fields = {"priority": seq.priority, "client_id": seq.client_id,
                      "deadline_s": seq.deadline_s, "attrs": thaw(seq.attrs)}
            with open(self.params.path, "a") as fh:
                fh.write(json.dumps(fields) + "\\n")

    @hookimpl
    def cbcore_register_policies():
        return [Recorder]
"""


@pytest.fixture(scope="module")
def small_server(cb_tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("small-server")
    (tmp / "recorder.py").write_text(textwrap.dedent(RECORDER))
    log = tmp / "arrivals.jsonl"
    config = {
        "plugins": [str(tmp / "recorder.py")],
        "scheduler": {"queue": {"name": "recorder", "path": str(log)}, "budget": {"max_num_seqs": 2}},
        "kv_cache": {"num_blocks": 30},  # 480 tokens, below the 512-token context
        "serve": {"max_waiting": 8, "shutdown_grace_s": 2.0},
    }
    (tmp / "config.json").write_text(json.dumps(config))
    server = ServerProcess(
        ["--model", str(cb_tiny_model_dir), "--config", str(tmp / "config.json"), "--threads", "1"],
        env={"OMP_NUM_THREADS": "1"},
    )
    with server:
        server.arrivals = log
        server.model = server_model(server.url)
        yield server


def server_model(url: str) -> str:
    return httpx.get(url + "/v1/models").json()["data"][0]["id"]


async def wait_for_metric(http: httpx.AsyncClient, name: str, value: float, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while metric((await http.get("/metrics")).text, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        await asyncio.sleep(0.05)


def test_scheduling_fields_reach_the_policies(small_server):
    client = openai.OpenAI(base_url=small_server.url + "/v1", api_key="-", max_retries=0)
    extra = {"priority": 3, "deadline_s": 2.5, "attrs": {"tier": "gold", "tags": ["a", 1]}}
    client.completions.create(
        model=small_server.model, prompt="hi", max_tokens=2, user="alice", extra_body=extra
    )
    client.completions.create(model=small_server.model, prompt="hi", max_tokens=2)
    records = [json.loads(line) for line in small_server.arrivals.read_text().splitlines()]
    assert records[-2:] == [
        {"priority": 3, "client_id": "alice", "deadline_s": 2.5, "attrs": {"tier": "gold", "tags": ["a", 1]}},
        {"priority": 0, "client_id": "default", "deadline_s": None, "attrs": {}},
    ]


def test_a_request_the_kv_cache_can_never_hold_is_a_400(small_server):
    client = openai.OpenAI(base_url=small_server.url + "/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="KV cache holds 480") as err:
        client.completions.create(model=small_server.model, prompt="hi", max_tokens=500)
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="KV cache holds 480"):
        client.completions.create(model=small_server.model, prompt=[5] * 490, max_tokens=1)


def test_a_full_waiting_queue_answers_503_with_retry_after(small_server):
    url, name = small_server.url, small_server.model

    async def scenario() -> httpx.Response:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0) as client:
            # 2 running, then 8 waiting: long requests that occupy the server until cancelled.
            holders = []
            async with httpx.AsyncClient(base_url=url) as http:
                for count, gauge in ((2, "running"), (8, "waiting")):
                    holders += [
                        asyncio.ensure_future(
                            stream_tokens(client, name, [5, 6, 7], 200, False, ignore_eos=True)
                        )
                        for _ in range(count)
                    ]
                    await wait_for_metric(http, f"cbcore:num_requests_{gauge}", count)
                full = await http.post(
                    "/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 1}
                )
            for h in holders:
                h.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            return full

    full = asyncio.run(scenario())
    assert full.status_code == 503, full.text
    assert full.headers["retry-after"] == "1"
    assert "8 requests are already waiting" in full.json()["error"]["message"]
    after = idle_metrics(url)
    assert metric(after, "cbcore:kv_cache_blocks_used") == 0


def test_sigterm_during_load_completes_or_cleanly_fails_every_request_and_exits_0(
    small_server, cb_tiny_model_dir
):
    """Last in this module: it stops the small server."""
    prompts = [[5 + i, 6, 7] for i in range(8)]  # 2 running, 6 waiting: below the 503 limit
    want = engine_outputs(cb_tiny_model_dir, prompts, [64] * 8, ignore_eos=True)
    url, name = small_server.url, small_server.model

    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        try:
            ids = await stream_tokens(client, name, prompts[i], 64, False, ignore_eos=True)
        except openai.APIError as exc:  # the error event a stream ends with when aborted at shutdown
            assert "shutting down" in str(exc), exc
            return "error"
        assert ids == want[i], f"request {i} ended early or wrong"
        return "complete"

    async def scenario() -> list[str]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0) as client:
            jobs = [asyncio.ensure_future(one(client, i)) for i in range(8)]
            async with httpx.AsyncClient(base_url=url) as http:
                await wait_for_metric(http, "cbcore:num_requests_running", 2)
            small_server.proc.send_signal(15)
            return await asyncio.wait_for(asyncio.gather(*jobs), timeout=120)

    outcomes = asyncio.run(scenario())
    print("outcomes at SIGTERM:", sorted(outcomes))
    assert set(outcomes) <= {"complete", "error"} and len(outcomes) == 8
    assert small_server.proc.wait(120) == 0, small_server.log_text()[-2000:]
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health")
