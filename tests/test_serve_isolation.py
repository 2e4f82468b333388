"""A plugin's failure costs `cb serve` only the request it concerns; what stops the engine says so and never hangs.

Against a real server on the tiny model, with the file plugin
``tests/support/mischief_plugins.py`` misbehaving for the one request whose ``attrs``
ask, among concurrent requests (the official ``openai`` client, streamed).
The other requests are compared with a run where the misbehaving request is
replaced by a harmless one: the same tokens and text. Each test ends with
every KV block free, as ``/metrics`` reports it.

* ``SystemExit`` and ``KeyboardInterrupt`` raised in ``key()`` fail that
  request with an error naming the plugin and the method; the server stays
  healthy, serves the next request exactly, and SIGTERM ends it promptly
  with exit code 0 (the module's server, at its teardown).
* A plugin raising for one request (in ``key()``, in ``on_arrival()``) fails
  it alone, and what its client reads, streamed or not, holds no other
  request's id and no path on the server, though the exception's text held
  both (the log has it).
* A plugin writing to everything it is handed and to views it kept from
  earlier requests: every write is refused, the writer's request alone ends.
* What concerns no single request (``limits()`` raising, a ``MemoryError``)
  stops the engine: every request in flight ends with the cause named,
  ``/health`` answers 503 with it, new requests get 503 naming it, nothing is
  held, and SIGTERM still ends the server with 0.

Without HTTP: anything else out of the engine (here a ``SystemExit`` from
engine code, which no door sees) stops it the same way, and its thread lives
on to refuse new work; what a client is told about a failure is built from
names, never from the exception's text.

The slow plugin and the watchdog: tests/test_serve_watchdog.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from test_serve_load import idle_metrics, metric

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.scheduling.door import PolicyError
from cbcore.scheduling.scheduler import SchedulerError
from cbcore.serve.channel import Accepted, Failed, Submission
from cbcore.serve.engine_loop import EngineLoop
from cbcore.serve.failures import public_reason
from cbcore.serve.launch import ServerProcess
from cbcore.testing import tiny_model

PLUGIN = Path(__file__).parent / "support" / "mischief_plugins.py"
QUEUE, BUDGET = "queue policy 'mischief'", "budget policy 'mischief-budget'"
PROMPTS = [[5, 6, 7], [9, 8, 7, 6, 5], [11, 12], [40, 41, 42, 43], [70, 71, 72, 73, 74, 75]]
CAPS = [24, 16, 20, 28, 12]
MARKED = 2  # the index of the request whose attrs ask the plugin to misbehave
HARMLESS = {"do": "nothing"}
SIGTERM_EXIT_S = 20  # "promptly": the server used to take about 40 s with a dead engine thread


@contextmanager
def serving(tmp: Path, model: Path, watchdog_s: float = 30.0) -> Iterator[ServerProcess]:
    """A server of its own (its files in ``tmp``) with the mischief plugins; SIGTERM ends it promptly, with 0."""
    tmp.mkdir()
    server = start_server(tmp, model, watchdog_s)
    try:
        yield server
    except BaseException:
        server.close()
        raise
    stop_promptly(server)


def start_server(tmp: Path, model: Path, watchdog_s: float) -> ServerProcess:
    report = tmp / "report.jsonl"
    config = {
        "plugins": [str(PLUGIN)],
        "scheduler": {
            "queue": {"name": "mischief", "report": str(report)},
            "budget": {"name": "mischief-budget", "report": str(report), "max_num_seqs": 16},
        },
        "kv_cache": {"num_blocks": 256},
        "serve": {"watchdog_s": watchdog_s, "shutdown_grace_s": 2.0},
    }
    (tmp / "config.json").write_text(json.dumps(config))
    server = ServerProcess(
        ["--model", str(model), "--config", str(tmp / "config.json"), "--threads", "1"],
        env={"OMP_NUM_THREADS": "1"},
    )
    server.report = report
    server.start()
    server.model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    return server


def stop_promptly(server: ServerProcess) -> None:
    t0 = time.monotonic()
    code = server.stop(timeout_s=SIGTERM_EXIT_S)
    server.close()
    assert code == 0, code
    print(f"SIGTERM to exit: {time.monotonic() - t0:.1f} s")


@pytest.fixture(scope="module")
def server(tmp_path_factory, cb_tiny_model_dir):
    """One server for the tests a plugin failure must not break."""
    with serving(tmp_path_factory.mktemp("mischief") / "shared", cb_tiny_model_dir) as server:
        yield server


async def one(client: openai.AsyncOpenAI, model: str, prompt: list[int], cap: int, attrs: dict) -> tuple:
    """("ok", token ids, text), or ("error", the message the client read)."""
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=cap, temperature=0, stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True, "attrs": attrs},
        )  # fmt: skip
        ids, text = [], ""
        async for chunk in stream:
            ids += chunk.choices[0].token_ids or []
            text += chunk.choices[0].text
        return ("ok", ids, text)
    except openai.APIError as exc:
        return ("error", said(exc))


def said(exc: openai.APIError) -> str:
    """The error's message as the server sent it (a status error's text is "Error code: ..." with the body)."""
    return exc.body.get("message", exc.message) if isinstance(exc.body, dict) else exc.message


def run_batch(server: ServerProcess, marked: dict) -> list[tuple]:
    """PROMPTS at once, the MARKED one with ``marked`` as its attrs."""

    async def batch() -> list[tuple]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=60) as client:
            jobs = [
                one(client, server.model, p, c, marked if i == MARKED else HARMLESS)
                for i, (p, c) in enumerate(zip(PROMPTS, CAPS, strict=True))
            ]
            return await asyncio.gather(*jobs)

    return asyncio.run(batch())


def assert_healthy_and_empty(server: ServerProcess) -> None:
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    after = idle_metrics(server.url)
    assert metric(after, "cbcore:kv_cache_blocks_used") == 0
    assert metric(after, "cbcore:num_requests_running") == metric(after, "cbcore:num_requests_waiting") == 0


@pytest.mark.parametrize(("do", "raised"), [("exit", "SystemExit"), ("interrupt", "KeyboardInterrupt")])
def test_a_plugin_exiting_or_interrupted_in_key_fails_only_its_request(server, do, raised):
    failing = run_batch(server, {"do": do})
    harmless = run_batch(server, HARMLESS)
    assert failing[MARKED] == ("error", f"{QUEUE} raised {raised} in key()")
    assert harmless[MARKED][0] == "ok"
    others = [i for i in range(len(PROMPTS)) if i != MARKED]
    assert [failing[i] for i in others] == [harmless[i] for i in others]
    assert all(harmless[i][0] == "ok" and len(harmless[i][1]) == CAPS[i] for i in others)
    # The next request is served exactly, and nothing is held.
    assert run_batch(server, HARMLESS) == harmless
    assert_healthy_and_empty(server)
    log = server.log_text()
    assert "raised in key() for request" in log and f"{raised}" in log and str(PLUGIN) in log  # the full detail


def test_a_plugin_raising_for_one_request_fails_it_alone_and_tells_no_other_id_or_path(server):
    failing = run_batch(server, {"do": "raise"})
    harmless = run_batch(server, HARMLESS)
    assert failing[MARKED] == ("error", f"{QUEUE} raised RuntimeError in key()")
    assert [f for i, f in enumerate(failing) if i != MARKED] == [h for i, h in enumerate(harmless) if i != MARKED]
    # The bodies as sent: plain and streamed, the failure in key() and in on_arrival().
    auth = {"Authorization": "Bearer -"}
    with httpx.Client(base_url=server.url + "/v1", headers=auth, timeout=60) as http:
        bystander = http.post("completions", json={"model": server.model, "prompt": [5, 6], "max_tokens": 2})
        ids = [bystander.json()["id"]]
        bodies = []
        for do, method in (("raise", "key"), ("raise_on_arrival", "on_arrival")):
            body = {"model": server.model, "prompt": [5, 6, 7], "max_tokens": 4, "attrs": {"do": do}}
            plain = http.post("completions", json=body)
            assert plain.status_code == 500, plain.text
            assert plain.json()["error"]["message"] == f"{QUEUE} raised RuntimeError in {method}()"
            streamed = http.post("completions", json={**body, "stream": True})
            assert f'"message":"{QUEUE} raised RuntimeError in {method}()"' in streamed.text, streamed.text
            bodies += [plain.text, streamed.text]
            ids += [json.loads(line[6:])["id"] for line in streamed.text.splitlines() if '"id"' in line]
    log = server.log_text()
    assert "cannot order" in log and "cannot take" in log  # the exception's own text: in the log only
    for text in bodies:
        assert "cmpl-" not in text and "/" not in text.replace("[DONE]", ""), text
    assert_healthy_and_empty(server)


def test_a_plugin_writing_to_what_it_is_handed_changes_nothing_and_ends_only_its_request(server):
    run_batch(server, HARMLESS)  # views of finished requests for the writer to keep and write to later
    server.report.write_text("")
    writing = run_batch(server, {"do": "write"})
    harmless = run_batch(server, HARMLESS)
    assert writing[MARKED][0] == "error" and writing[MARKED][1].startswith(f"{QUEUE} raised "), writing[MARKED]
    assert writing[MARKED][1].endswith("in on_step_end()"), writing[MARKED]
    assert [w for i, w in enumerate(writing) if i != MARKED] == [h for i, h in enumerate(harmless) if i != MARKED]
    tried = [json.loads(line) for line in server.report.read_text().splitlines()]
    through = [t["what"] for t in tried if t["refused"] is None]
    assert through == [], through
    whats = {t["what"] for t in tried}
    for expected in ("seq.block_table.append(0)", "seq.priority = ...", "seq.num_computed_tokens = ...",
                     "state.kv.num_free_blocks = ...", "state.now = ...", "results[0].new_token = ...",
                     "results[0].seq.output_token_ids.append(0)", "seq.attrs[...] = 0", "seq.params.temperature = ..."):  # fmt: skip
        assert expected in whats, expected
    assert any("(finished)." in w for w in whats), "no write to a kept view of a finished request"
    setting = {t["refused"] for t in tried if t["what"].endswith(" = ...")}
    assert setting <= {"AttributeError", "FrozenInstanceError", "ValidationError"}, setting  # (a frozen params)
    assert_healthy_and_empty(server)


@pytest.mark.parametrize(
    ("do", "cause"),
    [("stop", f"{BUDGET} raised RuntimeError in limits()"), ("memory", f"{QUEUE} raised MemoryError in key()")],
)
def test_what_concerns_no_single_request_stops_the_engine_loudly_and_never_hangs(tmp_path, cb_tiny_model_dir, do, cause):
    with serving(tmp_path / "server", cb_tiny_model_dir) as server:
        outcomes = run_batch(server, {"do": do})
        stopped = f"the engine stopped: {cause}"
        assert set(outcomes) == {("error", stopped)}, outcomes  # every request in flight, named
        health = httpx.get(server.url + "/health")
        assert (health.status_code, health.json()) == (503, {"status": stopped})
        refused = httpx.post(server.url + "/v1/completions", json={"model": server.model, "prompt": [5], "max_tokens": 2})
        assert (refused.status_code, refused.json()["error"]["message"]) == (503, stopped)
        after = idle_metrics(server.url)
        assert metric(after, "cbcore:kv_cache_blocks_used") == 0
        log = server.log_text()
        assert "the engine stopped" in log and str(PLUGIN) in log and "Traceback" in log  # the full detail


# -- the engine loop itself, without HTTP ----------------------------------------------------------


def test_whatever_else_comes_out_of_the_engine_stops_it_and_its_thread_lives_to_say_so():
    engine = Engine(tiny_model("llama"), config=EngineConfig.model_validate({"backend": {"name": "eager"}}))

    def exits(record):  # not a plugin: engine code failing with a BaseException (the door never sees it)
        raise SystemExit(f"a listener's bug in {__file__}")

    engine.step_listeners.append(exits)

    async def scenario() -> tuple:
        loop = EngineLoop(engine)
        loop.start(asyncio.get_running_loop())
        try:
            handle = loop.submit(Submission("r1", [5, 6, 7], SamplingParams(max_new_tokens=4)))
            events = [await asyncio.wait_for(handle.next(), 30) for _ in range(2)]
            refused = await asyncio.wait_for(loop.submit(Submission("r2", [5], SamplingParams())).next(), 30)
            return events, refused, loop.trouble, loop.alive
        finally:
            loop.stop()

    events, refused, trouble, alive = asyncio.run(scenario())
    stopped = "the engine stopped: SystemExit in the engine"
    assert events == [Accepted(), Failed(stopped, 500)] and refused == Failed(stopped, 503)
    assert trouble == stopped and alive
    assert not engine.has_unfinished() and engine.scheduler.blocks.num_used_blocks == 0


NAMES = {1: "queue policy 'q' (path /srv/plugins/q.py)", 2: "budget policy 'b' (built-in)"}


@pytest.mark.parametrize(
    ("exc", "told"),
    [
        (PolicyError("queue policy 'q' (path /srv/plugins/q.py) raised in limits(): KeyError: 'cmpl-1'",
                     plugin=NAMES[1], rule="limits() raised", request_id=None,
                     public="queue policy 'q' raised KeyError in limits()"), "queue policy 'q' raised KeyError in limits()"),
        (SchedulerError(f"{NAMES[1]}, {NAMES[2]} broke the rule 'x': 'cmpl-1' twice", plugin=f"{NAMES[1]}, {NAMES[2]}",
                        rule="each sequence is scheduled at most once"),
         "queue policy 'q', budget policy 'b' broke the rule 'each sequence is scheduled at most once'"),
        (MemoryError("cmpl-1 in /srv"), "MemoryError in the engine"),
        (RuntimeError("cmpl-1 in /srv"), "RuntimeError in the engine"),
    ],
)  # fmt: skip
def test_what_a_client_is_told_about_an_engine_failure_holds_no_request_id_and_no_path(exc, told):
    assert public_reason(exc, NAMES) == told
    cause = PolicyError("q raised for 'cmpl-1'", plugin=NAMES[1], rule="key() raised", request_id="cmpl-1",
                        public="queue policy 'q' raised KeyError in key()")  # fmt: skip
    again = SchedulerError(f"{cause}; the step failed 9 times", plugin=NAMES[1], rule="key() raised")
    again.__cause__ = cause
    assert public_reason(again, NAMES) == "queue policy 'q' raised KeyError in key(), for one request after another"
