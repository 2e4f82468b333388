"""cbcore-mlfq: quanta, skip-join entry, demotion, and output equivalence."""

from __future__ import annotations

from cbcore_mlfq import MLFQParams, SkipJoinMLFQ

from cbcore.scheduling.policy import StepResult
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.scheduling.sequence import Sequence
from cbcore.testing import random_prompts


def seq(rid: str, prompt_len: int, arrival: float = 0.0) -> Sequence:
    return Sequence(rid, [3] * prompt_len, SamplingParams(max_new_tokens=100), arrival_time=arrival)


def test_quanta_grow_geometrically() -> None:
    mlfq = SkipJoinMLFQ(MLFQParams(base_quantum=4, quantum_growth=3.0))
    assert [mlfq.quantum(level) for level in range(4)] == [4, 12, 36, 108]


def test_skip_join_places_long_prompts_lower() -> None:
    mlfq = SkipJoinMLFQ(MLFQParams(num_levels=3, base_quantum=2, prompt_token_cost=0.5))
    assert [mlfq.entry_level(seq("s", n)) for n in (1, 4, 5, 8, 9, 1000)] == [0, 0, 1, 1, 2, 2]


def test_demotion_after_the_quantum_and_order_by_level() -> None:
    mlfq = SkipJoinMLFQ(MLFQParams(num_levels=3, base_quantum=2))
    old, new = seq("old", 4, arrival=0.0), seq("new", 4, arrival=1.0)
    mlfq.on_arrival(old, 0.0)
    for _ in range(2):
        mlfq.on_step_end([StepResult(old, 1, 7)], now=1.0)
    assert mlfq.levels["old"] == 1
    mlfq.on_step_end([StepResult(old, 1, None)], now=1.0)  # a prefill chunk is not a generated token
    assert mlfq.levels["old"] == 1
    mlfq.on_arrival(new, 1.0)
    assert [s.request_id for s in mlfq.order([old, new], now=2.0)] == ["new", "old"]
    assert mlfq.outranks(new, old, now=2.0)
    mlfq.on_finish(old, 3.0)
    assert "old" not in mlfq.levels


def test_mlfq_keeps_outputs_identical(cb_equivalence) -> None:
    report = cb_equivalence(
        {
            "scheduler": {
                "queue": {"name": "mlfq", "base_quantum": 2},
                "budget": {"name": "token-budget", "max_num_seqs": 3, "max_num_batched_tokens": 16},
            },
            "kv_cache": {"block_size": 4, "num_blocks": 14},
        },
        prompts=random_prompts(6, 4, 24, seed=3),
        max_new_tokens=20,
    )
    assert report.engine.scheduler.num_preemptions > 0
    assert report.engine.scheduler.num_partial_prefills > 0
    assert report.engine.scheduler.door.queue.num_demotions > 0
