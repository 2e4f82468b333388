"""Helpers and session fixtures for the adapter tests: vLLM runs from its own venv (.venv-vllm) in a subprocess.

vLLM pins torch and transformers differently from cbcore, so these tests run in
cbcore's venv (for cbcore's engine, the reference side) and start vLLM from
``.venv-vllm`` (``make vllm-setup``). Start-ups are the cost here (about 20 s
to import vLLM, a few seconds per engine on the tiny model, more on the default
model), so every offline scenario runs in one driver process, one server
serves all the HTTP checks, and the processes start together.

This module is a pytest plugin of the whole session (the repository's root
``conftest.py`` names it), so its fixtures are the same objects for every
test: ``vllm_driver`` and ``vllm_servers`` start their processes in the
background and return at once with handles that wait when a test reads them,
and ``vllm_starts_early`` requests them at the session's first test when a
selected test uses them. vLLM's tests are collected last (``contrib/`` after
``tests/``); this way its start-ups, over a minute of one core's work, overlap
the rest of the suite, which mostly runs on one thread.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cbcore_vllm.check.model import tiny_llama
from cbcore_vllm.check.trace import Trace

ROOT = Path(__file__).resolve().parents[3]
VLLM_PY = Path(os.environ.get("CBCORE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
HERE = Path(__file__).resolve().parent
PLUGIN = str(HERE / "plugins" / "recorder.py")


def vllm_python() -> Path:
    if not VLLM_PY.exists():
        pytest.fail(f"{VLLM_PY} is missing: run `make vllm-setup` (the adapter tests need vLLM's own venv)")
    return VLLM_PY


def vllm_env() -> dict[str, str]:
    """vLLM's CPU build as its docs advise, sized for a 2-core machine and small caches."""
    env = dict(os.environ)
    iomp = VLLM_PY.parent.parent / "lib" / "libiomp5.so"
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="0-1" if (os.cpu_count() or 1) >= 2 else "0",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache, which `cb bench --server` calls before each run
    )
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    env.pop("VIRTUAL_ENV", None)
    return env


class Started:
    """A vLLM process started now and waited for where a test needs it.

    A start-up is mostly one core's worth of imports and model loading, so the
    suite's three vLLM processes (the offline driver, the server, the server
    that must refuse its config) start together and share the cores instead of
    starting one after another.
    """

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.log, self.t0 = log, time.monotonic()
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)

    def wait(self, timeout_s: float) -> str:
        """Its output once it has exited (killed, and the test failed, after ``timeout_s``)."""
        try:
            self.proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - self.t0)))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.proc.args[:3]} still running after {timeout_s} s:\n{self.log_tail()}") from None
        return self.log.read_text()

    def log_tail(self) -> str:
        return self.log.read_text()[-4000:]


def start_driver(scenarios: list[dict[str, Any]], workdir: Path) -> Started:
    """Every scenario through vLLM's offline engine, in one process (``python -m cbcore_vllm.check.batch``)."""
    spec = workdir / "spec.json"
    spec.write_text(json.dumps({"runs": scenarios}))
    cmd = [str(vllm_python()), "-m", "cbcore_vllm.check.batch", str(spec), str(workdir / "out.json")]
    return Started(cmd, vllm_env(), workdir / "driver.log")


def driver_results(driver: Started, workdir: Path, timeout_s: float = 1200) -> dict[str, Trace]:
    """Each scenario's trace (``error`` set where vLLM or the adapter refused it)."""
    driver.wait(timeout_s)
    out = workdir / "out.json"
    if driver.proc.returncode != 0 or not out.exists():
        raise AssertionError(f"vLLM driver failed (rc {driver.proc.returncode}):\n{driver.log_tail()}")
    results = {r["name"]: Trace.from_json(r["trace"]) for r in json.loads(out.read_text())["results"]}
    sys.stderr.write(f"vLLM driver: {time.monotonic() - driver.t0:.1f} s for {len(results)} engines\n")
    return results


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(model: Path, port: int, cbcore: dict[str, Any], *extra: str) -> list[str]:
    """vLLM's OpenAI server with the adapter, as docs/vllm.md starts it (its `vllm` script is broken here)."""
    return [
        str(vllm_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--scheduler-cls",
        "cbcore_vllm.Scheduler",
        "--middleware",
        "cbcore_vllm.RequestCheck",
        "--additional-config",
        json.dumps({"cbcore": cbcore}),
        "--enforce-eager",
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--max-model-len",
        "512",
        *extra,
    ]


def server_env() -> dict[str, str]:
    env = vllm_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server runs its engine core in a process of its own
    return env


def stop_server(proc: subprocess.Popen[str]) -> None:
    """SIGTERM, a minute to shut down, then SIGKILL."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def wait_healthy(proc: subprocess.Popen[str], port: int, log: Path, timeout_s: float = 900) -> float:
    """Seconds until /health answers 200; fails with the log's tail if the server dies first."""
    import urllib.request

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise AssertionError(f"vLLM server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(1.0)
    raise AssertionError(f"vLLM server not healthy after {timeout_s} s:\n{log.read_text()[-4000:]}")


# The default-model server's policies (test_vllm_server.py checks its tokens against cbcore's engine with them).
SERVER_SCHED = {
    "queue": {"name": "sjf"},
    "budget": {"name": "token-budget", "max_num_seqs": 4, "max_num_batched_tokens": 256},
    "prefill": {"name": "chunked-prefill", "chunk_size": 8},
}


#: Session fixtures that start vLLM processes in the background, requested early by ``vllm_starts_early``.
STARTS_EARLY = ("vllm_driver", "vllm_servers")
#: Those it started (a test checks that the driver was among them).
STARTED_EARLY: list[str] = []


@pytest.fixture(scope="session", autouse=True)
def vllm_starts_early(request: pytest.FixtureRequest) -> None:
    """At the session's first test: start each fixture of :data:`STARTS_EARLY` that a selected test uses.

    A start that fails here is left to the tests that use the fixture: pytest keeps the error and reports it
    on each of them, not on whichever unrelated test happens to run first."""
    used = {name for item in request.session.items for name in item.fixturenames}
    for name in STARTS_EARLY:
        if name in used:
            try:
                request.getfixturevalue(name)
            except (Exception, pytest.fail.Exception):
                continue
            STARTED_EARLY.append(name)


@pytest.fixture(scope="session")
def vllm_driver(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Started, Path]]:
    """The driver of every offline scenario (``scenarios`` of test_vllm_offline.py), started now; and its
    directory. :func:`driver_results` waits for it."""
    from test_vllm_offline import scenarios  # the module whose tests read the results decides what runs

    work = tmp_path_factory.mktemp("vllm-offline")
    driver = start_driver(scenarios(tiny_dir, work), work)
    yield driver, work
    if driver.proc.poll() is None:  # a run cut short
        driver.proc.kill()
        driver.proc.wait()


@pytest.fixture(scope="session")
def vllm_servers(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Both servers of test_vllm_server.py, started now: one on the default model with the recorder plugin's
    queue (``events`` is its log), and one on the tiny model naming an unknown plugin, which must exit.
    Stopped by :func:`stop_servers` when the tests that use them are done, else when the session ends."""
    from cbcore.models.default_model import default_model_dir

    work = tmp_path_factory.mktemp("vllm-servers")
    events, port = work / "events.jsonl", free_port()
    sched = {**SERVER_SCHED, "queue": {"name": "longest-prompt-first", "log": str(events)}}
    default = server_command(
        default_model_dir(), port, {"plugins": [PLUGIN], "scheduler": sched}, "--scheduling-policy", "priority",
        "--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--served-model-name", "smollm",
    )  # fmt: skip
    unknown = server_command(
        tiny_dir, free_port(), {"scheduler": {"queue": {"name": "priorty"}}},
        "--skip-tokenizer-init", "--max-num-batched-tokens", "256",
    )  # fmt: skip
    servers: dict[str, Any] = {
        "port": port,
        "events": events,
        "default": Started(default, server_env(), work / "server.log"),
        "unknown-plugin": Started(unknown, server_env(), work / "unknown-plugin.log"),
    }
    yield servers
    stop_servers(servers)


def stop_servers(servers: dict[str, Any]) -> None:
    """Stop those of ``servers`` still running (again: a no-op)."""
    for started in servers.values():
        if isinstance(started, Started) and started.proc.poll() is None:
            stop_server(started.proc)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama vLLM's CPU attention accepts (head size 64; its block size is a multiple of 32)."""
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
