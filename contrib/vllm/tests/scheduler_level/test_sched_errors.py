"""A bad per-request field ends that request alone, through the version's per-request error path."""

from __future__ import annotations

from sched_level import VERSION, drive

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
