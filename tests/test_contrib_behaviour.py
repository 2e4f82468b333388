"""Behaviour of the contrib queue policies (installed from contrib/) under the fake runner."""

from __future__ import annotations

import pytest
from cbcore_mlfq import MLFQParams, SkipJoinMLFQ
from cbcore_sjf import ShortestPredictedJobFirst, SJFParams
from cbcore_vtc import VirtualTokenCounter, VTCParams

from cbcore.policies import FCFS, ChunkedPrefill, WholePrompt
from cbcore.scheduling.policy import QueuePolicy
from cbcore.testing import FakeRun, budget

# -- VTC -----------------------------------------------------------------------------


def _two_backlogged_clients(
    queue: QueuePolicy, shapes: dict[str, tuple[int, int]]
) -> list[tuple[float, float]]:
    """Client a queues 30 requests, then client b queues 30; (served a, served b) after every
    step while both still have unfinished requests. Served = prompt tokens + 2 x generated."""
    run = FakeRun(queue, budget(max_seqs=4, max_tokens=64), ChunkedPrefill())
    for client, (plen, cap) in shapes.items():
        for i in range(30):
            run.add(f"{client}-{i:02d}", plen, cap, client=client)
            run.now += 0.001
    trace = []

    def backlogged(client: str) -> bool:
        return any(s.client_id == client and not s.is_finished for s in run.seqs.values())

    while backlogged("a") and backlogged("b"):
        run.step()
        trace.append((run.served.get("a", 0.0), run.served.get("b", 0.0)))
    return trace


@pytest.mark.parametrize(
    "shapes",
    [{"a": (8, 8), "b": (8, 8)}, {"a": (40, 2), "b": (2, 20)}],
    ids=["same-shape", "prompt-heavy-vs-output-heavy"],
)
def test_vtc_bounds_the_served_token_gap_fcfs_does_not(shapes: dict[str, tuple[int, int]]) -> None:
    cost = max(plen + 2 * cap for plen, cap in shapes.values())  # one request's weighted tokens
    vtc_gap = max(abs(a - b) for a, b in _two_backlogged_clients(VirtualTokenCounter(), shapes))
    fcfs_gap = max(abs(a - b) for a, b in _two_backlogged_clients(FCFS(), shapes))
    # VTC: within a few requests' worth (the batch holds 4) however long both stay backlogged.
    assert vtc_gap <= 4 * cost, (vtc_gap, cost)
    # FCFS serves a's whole backlog first: the gap grows with the backlog.
    assert fcfs_gap >= 15 * cost, (fcfs_gap, cost)


def test_vtc_weights_split_service_in_proportion() -> None:
    vtc = VirtualTokenCounter(VTCParams(weights={"a": 2.0}))
    trace = _two_backlogged_clients(vtc, {"a": (8, 8), "b": (8, 8)})
    # a is owed twice b's service: the weighted gap stays bounded, the plain one grows
    assert max(abs(a / 2 - b) for a, b in trace) <= 4 * 24
    a, b = trace[len(trace) // 2]
    assert 1.8 <= a / b <= 2.2, (a, b)


def test_vtc_lifts_a_returning_client_to_the_active_minimum() -> None:
    vtc = VirtualTokenCounter()
    run = FakeRun(vtc, budget(max_seqs=2), WholePrompt())
    for i in range(6):
        run.add(f"a-{i}", 10, 10, client="a")
    for _ in range(30):
        run.step()
    assert vtc.counter("a") > 100
    run.add("b-0", 10, 10, client="b")
    # b was never served, but it may not claim the service a received while b was away
    assert vtc.counter("b") == pytest.approx(vtc.counter("a"))


# -- MLFQ ----------------------------------------------------------------------------


def test_mlfq_demotes_after_each_levels_quantum() -> None:
    mlfq = SkipJoinMLFQ()  # quanta 8, 16, 32, 64 on levels 0-3
    run = FakeRun(mlfq, budget(), WholePrompt())
    run.add("long", 4, 100)
    levels = []
    while run.sched.has_unfinished():
        run.step()
        if not run.seqs["long"].is_finished:
            levels.append((run.seqs["long"].num_output_tokens, mlfq.levels["long"]))
    change = [(n, lvl) for (n, lvl), (_, prev) in zip(levels[1:], levels, strict=False) if lvl != prev]
    assert change == [(8, 1), (24, 2), (56, 3)]
    assert mlfq.num_demotions == 3


@pytest.mark.parametrize(
    ("prompt_len", "level"), [(128, 0), (129, 1), (256, 1), (257, 2), (600, 3), (5000, 3)]
)
def test_mlfq_skip_join_enters_by_prompt_cost(prompt_len: int, level: int) -> None:
    mlfq = SkipJoinMLFQ()
    run = FakeRun(mlfq, num_blocks=2048)
    run.add("r", prompt_len, 1)
    assert mlfq.levels["r"] == level


@pytest.mark.parametrize(("queue", "short_first"), [(SkipJoinMLFQ(), True), (FCFS(), False)])
def test_mlfq_lets_a_newcomer_past_demoted_long_jobs(queue: QueuePolicy, short_first: bool) -> None:
    run = FakeRun(queue, budget(max_seqs=2), WholePrompt())
    run.add("long-1", 4, 80)
    run.add("long-2", 4, 80)
    for _ in range(30):  # both long jobs sink to level 2
        run.step()
    run.add("short", 4, 4)
    run.run()
    finish = {rid: s.finish_time for rid, s in run.seqs.items()}
    assert (finish["short"] < min(finish["long-1"], finish["long-2"])) is short_first
    if short_first:
        assert run.sched.num_preemptions == 1  # the newcomer took a slot from a level-2 job


@pytest.mark.parametrize("promote_after_s", [None, 5.0])
def test_mlfq_promotes_a_starved_request(promote_after_s: float | None) -> None:
    mlfq = SkipJoinMLFQ(MLFQParams(num_levels=2, base_quantum=2, promote_after_s=promote_after_s))
    run = FakeRun(mlfq, budget(max_seqs=1), WholePrompt())
    run.add("old", 4, 10)

    def arrive(r: FakeRun) -> None:  # a new level-0 request every step for 60 steps
        if len(r.steps) < 60:
            r.add(f"new-{len(r.steps)}", 4, 3)

    run.run(each=arrive)
    finished_during_stream = run.seqs["old"].finish_time < 60
    assert finished_during_stream is (promote_after_s is not None)
    assert (mlfq.num_promotions > 0) is (promote_after_s is not None)


# -- SJF -----------------------------------------------------------------------------


def test_sjf_admits_shortest_predicted_first_and_ages() -> None:
    sjf = ShortestPredictedJobFirst(SJFParams(predictor="max-new-tokens", aging_s=None))
    run = FakeRun(sjf, budget(max_seqs=1), WholePrompt())
    for rid, cap in [("long", 30), ("short", 2), ("mid", 10)]:
        run.add(rid, 4, cap)
    run.run()
    assert [rid for step in run.steps for rid in step.first_time] == ["short", "mid", "long"]


def test_sjf_aging_prevents_starvation() -> None:
    def start_of_long(aging_s: float | None) -> int:
        run = FakeRun(
            ShortestPredictedJobFirst(SJFParams(predictor="max-new-tokens", aging_s=aging_s)),
            budget(max_seqs=1),
        )
        run.add("long", 4, 50)

        def arrive(r: FakeRun) -> None:
            if len(r.steps) < 60:
                r.add(f"short-{len(r.steps)}", 4, 1)

        run.run(each=arrive)
        return next(i for i, step in enumerate(run.steps) if "long" in step.first_time)

    assert start_of_long(None) >= 60  # a steady stream of short jobs starves it
    assert start_of_long(1.0) < 60
