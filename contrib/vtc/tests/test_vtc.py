"""cbcore-vtc: counters, the returning-client lift, interleaving, and output equivalence."""

from __future__ import annotations

import pytest
from cbcore_vtc import VirtualTokenCounter, VTCParams
from pydantic import ValidationError

from cbcore.scheduling.policy import StepResult
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.scheduling.sequence import Sequence
from cbcore.testing import random_prompts


def seq(rid: str, client: str, prompt_len: int = 10, arrival: float = 0.0) -> Sequence:
    return Sequence(
        rid, [3] * prompt_len, SamplingParams(max_new_tokens=8), client_id=client, arrival_time=arrival
    )


def serve(vtc: VirtualTokenCounter, s: Sequence, computed: int, token: int | None) -> None:
    s.num_computed_tokens += computed
    vtc.on_step_end([StepResult(s, computed, token)], now=0.0)


def test_counters_charge_prompt_tokens_once_and_weighted_outputs() -> None:
    vtc = VirtualTokenCounter(VTCParams(input_weight=1.0, output_weight=2.0, weights={"b": 2.0}))
    a, b = seq("a", "a"), seq("b", "b")
    for s in (a, b):
        vtc.on_arrival(s, now=0.0)
    serve(vtc, a, 6, None)  # first chunk
    serve(vtc, a, 4, 9)  # last chunk + first token
    assert vtc.counter("a") == pytest.approx(10 + 2)
    a.num_computed_tokens = 0  # preempted by recompute: the prompt runs again, uncharged
    serve(vtc, a, 11, 9)
    assert vtc.counter("a") == pytest.approx(12 + 2)
    serve(vtc, b, 10, 9)
    assert vtc.counter("b") == pytest.approx((10 + 2) / 2.0)


def test_a_returning_client_is_lifted_to_the_active_minimum() -> None:
    vtc = VirtualTokenCounter()
    a1, a2, c = seq("a1", "a"), seq("a2", "a"), seq("c", "c")
    vtc.on_arrival(a1, 0.0)
    vtc.on_arrival(c, 0.0)
    serve(vtc, a1, 10, 1)
    serve(vtc, c, 10, 1)
    serve(vtc, c, 1, 1)
    b = seq("b", "b")
    vtc.on_arrival(b, 1.0)
    assert vtc.counter("b") == pytest.approx(min(vtc.counter("a"), vtc.counter("c")))
    # With nobody backlogged, a newcomer starts from the counter of the last client to leave.
    for s in (a1, c, b):
        vtc.on_finish(s, 2.0)
    vtc.on_arrival(a2, 3.0)
    d = seq("d", "d")
    vtc.on_arrival(d, 3.0)
    assert vtc.counter("d") == pytest.approx(vtc.counter("a"))


def test_order_interleaves_clients_by_tentative_counters() -> None:
    vtc = VirtualTokenCounter()
    seqs = [seq(f"a{i}", "a", arrival=i) for i in range(3)] + [
        seq(f"b{i}", "b", arrival=10 + i) for i in range(3)
    ]
    for s in seqs:
        vtc.on_arrival(s, 0.0)
    assert [s.request_id for s in vtc.order(seqs, now=20.0)] == ["a0", "b0", "a1", "b1", "a2", "b2"]
    vtc.counters["a"] = 100.0  # a has been served a lot: b's requests go first
    assert [s.request_id for s in vtc.order(seqs, now=20.0)][:3] == ["b0", "b1", "b2"]
    assert not vtc.outranks(seqs[3], seqs[0], now=20.0)  # no preemptive admission unless asked
    eager = VirtualTokenCounter(VTCParams(preempt_running=True))
    eager.counters["a"] = 100.0
    assert eager.outranks(seqs[3], seqs[0], now=20.0)


def test_client_weights_must_be_positive() -> None:
    with pytest.raises(ValidationError, match="client weights must be > 0"):
        VTCParams(weights={"a": 0})


def test_vtc_keeps_outputs_identical(cb_equivalence) -> None:
    report = cb_equivalence(
        {
            "scheduler": {
                "queue": {"name": "vtc", "weights": {"alice": 2.0}},
                "budget": {"name": "token-budget", "max_num_seqs": 4, "max_num_batched_tokens": 16},
            },
            "kv_cache": {"block_size": 4, "num_blocks": 14},
        },
        prompts=random_prompts(6, 4, 24, seed=1),
        max_new_tokens=20,
        client_ids=["alice", "bob", "bob", "alice", "carol", "bob"],
    )
    assert report.engine.scheduler.num_preemptions > 0
    assert report.engine.scheduler.num_partial_prefills > 0
