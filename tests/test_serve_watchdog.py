"""The watchdog: a call into the engine that runs past ``serve.watchdog_s`` is named, reported and outlived.

* Over HTTP (a server with a bound of WATCHDOG_S): a plugin sleeping in
  ``key()`` for one request while three streams run. ``/health`` turns 503
  within the bound + 1 s, naming the plugin and the method; ``/metrics``
  has ``engine_stalled`` for them; the streams end with that error during
  the stall (never silence) and a new request gets 503 naming it. Once the
  call returns, the request it concerned ends with "took longer than the
  watchdog's ...", the server is healthy, serves the next request exactly,
  and nothing is held. A call that never returns leaves the server
  unhealthy, and SIGTERM still ends it promptly with 0.
* On an engine stepped here: the stall names a whole-scheduler plugin's
  method, or the engine's own call when no plugin is on the stack, and it
  ends when the call returns.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_serve_isolation import HARMLESS, QUEUE, one, said, serving, stop_promptly
from test_serve_load import idle_metrics, metric

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.scheduling.scheduler import SchedulerOutput, SchedulerPlugin
from cbcore.serve.watchdog import ENGINE, Stall, Watchdog
from cbcore.testing import tiny_model

WATCHDOG_S, SLEEP_S = 1.0, 4.0
STALLED = f"stalled in {QUEUE}.key(): running for more than the watchdog's 1 s"
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def server(tmp_path_factory, cb_tiny_model_dir):
    with serving(tmp_path_factory.mktemp("watchdog") / "server", cb_tiny_model_dir, WATCHDOG_S) as server:
        yield server


def stall_series(text: str) -> dict[tuple[str, str], float]:
    """``cbcore:engine_stalled`` by (plugin, method)."""
    families = [f for f in text_string_to_metric_families(text) if f.name == "cbcore:engine_stalled"]
    return {(s.labels["plugin"], s.labels["method"]): s.value for f in families for s in f.samples}


def test_a_slow_plugin_is_named_within_the_bound_and_the_server_recovers(server):
    async def scenario() -> dict:
        seen: dict = {"health": [], "metrics": None, "refused": None}
        async with (
            openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=60) as client,
            httpx.AsyncClient(base_url=server.url, timeout=60) as http,
        ):
            before = await one(client, server.model, PROMPT, 8, HARMLESS)
            started = asyncio.Event()
            ended: list[tuple[float, tuple]] = []

            async def stream(i: int) -> None:  # long enough to be running when the stall begins
                response = await client.completions.create(
                    model=server.model, prompt=[9, i], max_tokens=400, stream=True, extra_body={"ignore_eos": True})
                try:
                    async for n, _ in aenumerate(response):
                        if n == 2:
                            started.set()
                    ended.append((time.time(), ("ok",)))
                except openai.APIError as exc:
                    ended.append((time.time(), ("error", exc.message)))

            streams = [asyncio.ensure_future(stream(i)) for i in range(3)]
            await asyncio.wait_for(started.wait(), 60)
            sleeper = asyncio.ensure_future(one(client, server.model, PROMPT, 8, {"do": "sleep", "s": SLEEP_S}))
            while True:  # /health, every 50 ms, until it says the engine has stalled
                health = await http.get("/health")
                seen["health"].append((time.time(), health.status_code, health.json()))
                if health.status_code == 503:
                    break
                await asyncio.sleep(0.05)
            seen["metrics"] = stall_series((await http.get("/metrics")).text)
            body = {"model": server.model, "prompt": PROMPT, "max_tokens": 2}
            refused = await http.post("/v1/completions", json=body)
            seen["refused"] = (refused.status_code, refused.json()["error"]["message"])
            await asyncio.wait_for(asyncio.gather(*streams), 60)
            seen["streams"] = ended
            seen["sleeper"] = await asyncio.wait_for(sleeper, 60)
            deadline = time.monotonic() + SLEEP_S + 30
            while (await http.get("/health")).status_code != 200:  # the call returns: healthy again
                assert time.monotonic() < deadline, "still stalled long after the call returned"
                await asyncio.sleep(0.05)
            seen["after"] = await one(client, server.model, PROMPT, 8, HARMLESS)
            seen["before"] = before
        return seen

    seen = asyncio.run(scenario())
    slept_from = json.loads(server.report.read_text().splitlines()[-1])["slept_from"]
    t503, status, said = seen["health"][-1]
    assert (status, said) == (503, {"status": STALLED})
    assert t503 - slept_from <= WATCHDOG_S + 1, f"/health turned 503 {t503 - slept_from:.2f} s after the sleep began"
    print(f"/health turned 503 {t503 - slept_from:.2f} s after the sleep began (bound {WATCHDOG_S} s)")
    assert seen["metrics"] == {(QUEUE, "key"): 1.0}
    assert seen["refused"] == (503, STALLED)
    # Every stream was told during the stall, not after the call returned: never silence.
    assert [outcome for _, outcome in seen["streams"]] == [("error", STALLED)] * 3, seen["streams"]
    assert all(t < slept_from + SLEEP_S for t, _ in seen["streams"]), (slept_from, seen["streams"])
    assert seen["sleeper"] == ("error", STALLED)
    assert seen["after"] == seen["before"] and seen["after"][0] == "ok"
    after = idle_metrics(server.url)
    assert stall_series(after) == {(QUEUE, "key"): 0.0}
    assert metric(after, "cbcore:kv_cache_blocks_used") == 0
    log = server.log_text()
    assert "the engine stalled" in log and "time.sleep(seq.attrs" in log  # named, with the engine thread's stack
    assert "key() took longer than the watchdog's 1 s" in log and "the engine resumed after a stall" in log


def test_a_call_that_never_returns_leaves_the_server_unhealthy_and_sigterm_still_ends_it(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=60)
    with pytest.raises(openai.APIError) as stalled:  # told within the bound, though the call goes on
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, extra_body={"attrs": {"do": "sleep", "s": 3600}})
    assert said(stalled.value) == STALLED
    time.sleep(WATCHDOG_S)
    health = httpx.get(server.url + "/health")
    assert (health.status_code, health.json()) == (503, {"status": STALLED})
    stop_promptly(server)  # the engine thread is not waited for while it is stalled


async def aenumerate(stream):
    n = 0
    async for item in stream:
        yield n, item
        n += 1


# -- the watchdog on an engine stepped here ----------------------------------------------------


class SlowWhole(SchedulerPlugin):
    """A whole scheduler that plans nothing, slowly."""

    name = "slow-whole"
    sleep_s = 0.0

    def add(self, seq):
        pass

    def schedule(self):
        time.sleep(self.sleep_s)
        return SchedulerOutput()

    def on_step_end(self, output, results):
        pass

    def abort(self, request_id):
        return None



def watched_step(engine: Engine, bound_s: float) -> list[tuple[Stall, bool]]:
    """One step under a watchdog of ``bound_s``; the stalls it reported, begun (True) and ended (False)."""
    told: list[tuple[Stall, bool]] = []
    watchdog = Watchdog(engine.scheduler, bound_s, threading.Lock(), lambda s: told.append((s, True)),
                        lambda s: told.append((s, False)))  # fmt: skip
    watchdog.start(threading.current_thread())
    try:
        watchdog.busy("step")
        try:
            engine.step()
        finally:
            watchdog.idle()
    finally:
        watchdog.stop()
    return told


def test_a_whole_scheduler_stalling_is_named_and_the_stall_ends_when_it_returns():
    config = EngineConfig.model_validate({"backend": {"name": "eager"}, "scheduler": {"name": f"{__file__}:SlowWhole"}})
    engine = Engine(tiny_model("llama"), config=config)
    engine.scheduler.plugin.sleep_s = 0.4
    told = watched_step(engine, 0.05)
    assert [(s.where, s.request_id, begun) for s, begun in told] == [
        ("scheduler 'slow-whole'.schedule()", None, True), ("scheduler 'slow-whole'.schedule()", None, False)]
    assert told[0][0].labels == ("scheduler 'slow-whole'", "schedule")


def test_a_stall_outside_any_plugin_is_the_engines_own():
    engine = Engine(tiny_model("llama"), config=EngineConfig.model_validate({"backend": {"name": "eager"}}))
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2))
    engine.step_listeners.append(lambda record: time.sleep(0.4))  # engine code, no plugin on the stack
    told = watched_step(engine, 0.05)
    assert [(s.plugin, s.where, begun) for s, begun in told] == [(ENGINE, "the engine's step()", True),
                                                                 (ENGINE, "the engine's step()", False)]  # fmt: skip
    assert told[0][0].message == "stalled in the engine's step(): running for more than the watchdog's 0.05 s"
