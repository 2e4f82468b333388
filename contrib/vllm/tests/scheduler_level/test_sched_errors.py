"""A bad per-request field, or a plugin failing about one request, ends that request alone, through the
version's per-request error path (the adapter's shim), in sync and async scheduling alike."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from cbcore_vllm._cbcore import SIGNALLED
from sched_level import PLUGIN, VERSION, drive

BUDGET = {"scheduler": {"budget": {"name": "token-budget", "max_num_seqs": 1, "max_num_batched_tokens": 64}}}


def test_bad_vllm_xargs_end_that_request_with_a_reason_and_the_others_are_served() -> None:
    requests = [
        {"id": "X", "prompt": [1, 7, 7, 7], "max_tokens": 3, "arrive": 0},
        {"id": "A", "prompt": [1, 8, 9], "max_tokens": 2, "arrive": 1, "xargs": {"deadline_s": -1}},
        {"id": "B", "prompt": [1, 11, 12], "max_tokens": 2, "arrive": 1, "xargs": {"attrs": "{not json"}},
        {"id": "C", "prompt": [1, 21, 22], "max_tokens": 2, "arrive": 1},
    ]
    driver, decisions = drive(BUDGET, requests, max_num_seqs=1, max_num_batched_tokens=64)
    done = driver.finished()
    assert {rid: o.finish_reason.name for rid, o in done.items()} == {"X": "LENGTH", "A": "ERROR", "B": "ERROR",
                                                                      "C": "LENGTH"}  # fmt: skip
    assert [rid for _, rid in decisions.first_scheduled()] == ["X", "C"]
    assert len(done["C"].new_token_ids) == 1 and driver.scheduler.get_num_unfinished_requests() == 0
    errors = {rid: getattr(done[rid], "error", None) for rid in "AB"}
    if VERSION == "0.32.0":  # its outputs carry no reason (the API middleware answers 400 before the engine)
        assert errors == {"A": None, "B": None}
    else:  # a validation_error: vLLM's API server answers 400 with this message
        assert {e.code for e in errors.values()} == {"validation_error"}
        assert errors["A"].message == "vllm_xargs: deadline_s must be finite and > 0, got -1"
        assert "vllm_xargs: attrs must be a JSON object (or its JSON text)" in errors["B"].message



def _mixed(mischief: dict | None) -> list[dict]:
    """Four requests decoding together; B's attrs make the recorder's key() fail (or, None: B is harmless)."""
    xargs = {"xargs": {"attrs": mischief}} if mischief else {}
    return [
        {"id": "X", "prompt": [1, 7, 7, 7], "max_tokens": 6, "arrive": 0},
        {"id": "A", "prompt": [1, 8, 9], "max_tokens": 6, "arrive": 0},
        {"id": "B", "prompt": [1, 11, 12, 13, 14], "max_tokens": 6, "arrive": 1, **xargs},
        {"id": "C", "prompt": [1, 21, 22], "max_tokens": 6, "arrive": 2},
    ]


def _tokens(driver, rid: str) -> list[int]:
    return [t for o in driver.outputs if o.request_id == rid for t in o.new_token_ids]


@pytest.fixture
def process_signals() -> Iterator[None]:
    """This process's SIGINT and SIGTERM handlers and SIGNALLED as they were: the adapter wraps the handlers
    it finds (cbcore_vllm.signals), and a test that shows it others must not leave them to the next test."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    SIGNALLED.clear()


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize(
    "mischief",
    [{"mischief": "raise"}, {"mischief": "exit"}, {"mischief": "interrupt"}, {"mischief": "exit", "after": 2}],
    ids=["raise-at-arrival", "exit-at-arrival", "interrupt-at-arrival", "exit-mid-decode"],
)
def test_a_plugin_failing_about_one_request_ends_it_alone_and_the_others_are_served(
    mischief: dict, mode: str, monkeypatch: pytest.MonkeyPatch, process_signals: None
) -> None:
    """RuntimeError, SystemExit or KeyboardInterrupt from key() about B: B ends with an error, vLLM's scheduler
    lives on, the others run to their length in the order they have beside a harmless B, nothing stays held."""
    # vLLM's engine-core process installs its own SIGINT handler, so a KeyboardInterrupt there is not a Ctrl-C
    # (cbcore.scheduling.door.interrupted): the same here, where pytest's default handler would say it is.
    monkeypatch.setattr(signal, "getsignal", lambda signum: (lambda *a: None))
    config = {"plugins": [PLUGIN], "scheduler": {"queue": {"name": "longest-prompt-first"},
              "budget": {"name": "token-budget", "max_num_seqs": 4, "max_num_batched_tokens": 64}}}  # fmt: skip
    kw = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "async_scheduling": mode == "async"}
    harmless, order = drive(config, _mixed(None), **kw)
    failing, failing_order = drive(config, _mixed(mischief), **kw)
    done = failing.finished()
    assert {rid: o.finish_reason.name for rid, o in done.items()} == {"X": "LENGTH", "A": "LENGTH", "B": "ERROR",
                                                                      "C": "LENGTH"}  # fmt: skip
    assert {rid: o.finish_reason.name for rid, o in harmless.finished().items()} == dict.fromkeys("XABC", "LENGTH")
    assert [len(_tokens(failing, rid)) for rid in "XAC"] == [6, 6, 6]
    # B got the tokens it had before key() failed about it (async: at most one more, already in flight).
    assert mischief.get("after", 0) <= len(_tokens(failing, "B")) <= mischief.get("after", 0) + (mode == "async")
    firsts = [rid for _, rid in order.first_scheduled()]
    assert [rid for _, rid in failing_order.first_scheduled() if rid != "B"] == [r for r in firsts if r != "B"]
    # Nothing held afterwards, and the scheduler serves the next request.
    pool = failing.scheduler.kv_cache_manager.block_pool
    assert failing.scheduler.get_num_unfinished_requests() == 0
    assert pool.get_num_free_blocks() == harmless.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    failing.run([{"id": "Y", "prompt": [1, 7, 7, 7], "max_tokens": 6, "arrive": 0}])
    assert failing.finished()["Y"].finish_reason.name == "LENGTH" and len(_tokens(failing, "Y")) == 6
    if VERSION != "0.32.0":  # 0.32.0's outputs carry no reason
        assert done["B"].error.code == "plugin_error"


def test_a_signal_during_a_policy_call_stays_a_shutdown(process_signals: None) -> None:
    """vLLM's engine core raises SystemExit from its SIGTERM handler: arriving while key() runs, it must stop
    the engine as a shutdown (cbcore_vllm.signals), not end the request key() was asked about."""

    def vllm_handler(signum: int, frame: object) -> None:  # what vLLM's engine core installs
        raise SystemExit()

    signal.signal(signal.SIGTERM, vllm_handler)
    SIGNALLED.clear()
    config = {"plugins": [PLUGIN], "scheduler": {"queue": {"name": "longest-prompt-first"}}}
    with pytest.raises(SystemExit):
        drive(config, _mixed({"mischief": "sigterm", "after": 2}), max_num_seqs=4, max_num_batched_tokens=64)
    assert SIGNALLED.is_set()
