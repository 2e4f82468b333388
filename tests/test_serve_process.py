"""`cb serve` as a process: its address checked before the model loads, and Ctrl-C twice.

* An address that cannot be served (``--host 256.1.1.1``, an address of no
  interface here, a port in use) fails in a moment with one line naming it,
  before the model is looked for (the model given does not exist: were it
  loaded first, that would be the error). Binding ``localhost`` at port 0
  gives every address one port.
* SIGINT twice under load (20 streams, the official client): every stream
  ends with the shutdown error event, the server is done within seconds and
  the process exits 130, and its log holds no traceback (it used to exit 0
  after 51). A request
  that keeps the shutdown waiting (its body never ends) does not keep the
  process: it exits 130 a few seconds after the second SIGINT.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest
from support import SERVE_KEY
from support.serve_client import connect, head, long_context_model_dir

from cbcore.cli.main import main
from cbcore.serve.launch import ServerProcess
from cbcore.serve.listen import BindError, bind
from cbcore.serve.server import FORCED_EXIT_S, INTERRUPTED

DONE = "cb serve: interrupted twice: the requests in flight were ended"


@pytest.mark.parametrize(
    ("host", "message"),
    [
        ("256.1.1.1", "--host 256.1.1.1: not an IPv4 address (Octet 256 (> 255) not permitted in '256.1.1.1')"),
        ("192.0.2.1", "cannot listen on 192.0.2.1:8000: Cannot assign requested address"),  # TEST-NET-1
    ],
)
def test_a_bad_host_fails_before_the_model_is_looked_for(host, message, capsys, tmp_path):
    code = main(["serve", "--model", str(tmp_path / "no-such-model"), "--host", host, "--port", "8000"])
    assert (code, capsys.readouterr().err) == (2, f"cb: error: {message}\n")


def test_a_port_in_use_fails_before_the_model_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["serve", "--model", str(tmp_path / "no-such-model"), "--port", str(port)]
        done = subprocess.run([sys.executable, "-m", "cbcore.cli.main", *args], capture_output=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.decode() == f"cb: error: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_localhost_at_port_0_is_one_port_for_every_address():
    sockets = bind("localhost", 0)
    try:
        ports = {sock.getsockname()[1] for sock in sockets}
        assert len(ports) == 1 and ports != {0}
        with pytest.raises(BindError, match=r"Address already in use"):
            bind(sockets[0].getsockname()[0], ports.pop())
    finally:
        for sock in sockets:
            sock.close()


@pytest.fixture
def long_server(tmp_path_factory):
    """A server of its own (these tests end it), on a model whose requests outlast the test."""
    args = ["--model", str(long_context_model_dir(tmp_path_factory)), "--api-key", SERVE_KEY, "--threads", "1"]
    args += ["--set", "kv_cache.num_blocks=2048", "--set", "scheduler.budget.max_num_seqs=32"]  # all 20 run
    server = ServerProcess(args, env={"OMP_NUM_THREADS": "1"})
    with server:
        yield server


def test_ctrl_c_twice_under_load_ends_every_stream_and_exits_130_without_a_traceback(long_server):
    client = openai.OpenAI(base_url=long_server.url + "/v1", api_key=SERVE_KEY, max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    outcomes: list[str] = []
    started = threading.Semaphore(0)

    def stream() -> None:
        try:
            chunks = client.completions.create(
                model=model, prompt=[5, 6, 7], max_tokens=15000, stream=True, extra_body={"ignore_eos": True}
            )
            for i, _ in enumerate(chunks):
                if i == 1:
                    started.release()
            outcomes.append("completed")
        except openai.APIError as exc:
            outcomes.append(str(exc.message))

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(20)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert started.acquire(timeout=60), (outcomes, long_server.log_text()[-2000:])
    long_server.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)  # two signals at once would be one
    t0 = time.monotonic()
    long_server.proc.send_signal(signal.SIGINT)
    while DONE not in long_server.log_text() and long_server.proc.poll() is None:
        time.sleep(0.01)
    served_until = time.monotonic() - t0  # the process itself takes seconds more to wind down (torch)
    code = long_server.proc.wait(30)
    for thread in threads:
        thread.join(30)
    log = long_server.log_text()
    assert code == INTERRUPTED and served_until < FORCED_EXIT_S, (code, served_until, log[-2000:])
    assert outcomes == ["the server is shutting down"] * 20, outcomes
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    assert "interrupted again: ending the requests in flight now" in log
    assert log.rstrip().endswith(DONE) and "without waiting" not in log


def test_a_request_that_keeps_the_shutdown_waiting_does_not_keep_the_process(long_server):
    with connect(long_server.url) as sock:  # a body that never ends: the shutdown would wait for its 408
        sock.sendall(head("POST", "/v1/completions", {"Authorization": f"Bearer {SERVE_KEY}", "Content-Length": "99"}))
        sock.sendall(b'{"model": ')
        time.sleep(0.3)
        long_server.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        t0 = time.monotonic()
        long_server.proc.send_signal(signal.SIGINT)
        code = long_server.proc.wait(30)
        exited_after = time.monotonic() - t0
    log = long_server.log_text()
    assert code == INTERRUPTED and FORCED_EXIT_S - 0.5 < exited_after < FORCED_EXIT_S + 5, (code, exited_after)
    assert log.rstrip().endswith(f"cb serve: still shutting down {FORCED_EXIT_S:g} s later: exiting without waiting")
    assert "Traceback" not in log, log[-3000:]
