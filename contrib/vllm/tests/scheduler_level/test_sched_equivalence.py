"""Decision equivalence on every tested version: cbcore's engine against vLLM's scheduler with the adapter.

The multi-tenant trace of the end-to-end tests (vllm_trace.py) through
cbcore's engine (a tiny random model, in this venv) and through this
version's scheduler (fake outputs): the same first-scheduled order, no
victims, and every divergence a documented one -- as ``python -m
cbcore_vllm.check --vllm scheduler`` reports it. Async scheduling keeps the
order and shifts the steps, as docs/vllm.md says; that is pinned too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cbcore_vllm.check.compare import compare
from cbcore_vllm.check.differences import applicable, load
from cbcore_vllm.check.model import tiny_llama
from sched_level import PLUGIN, VERSION, drive
from vllm_trace import EQUIVALENCE, LIMITS, STEP_S, run_cbcore, trace

BLOCKS = 200


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def vllm_run(policy: str, async_scheduling: bool = False):
    config = {"plugins": [PLUGIN], "scheduler": {"budget": LIMITS, **EQUIVALENCE[policy]}, "clock": {"step_s": STEP_S}}
    return drive(config, trace(), max_num_seqs=2, max_num_batched_tokens=64, num_blocks=BLOCKS,
                 async_scheduling=async_scheduling)[1]  # fmt: skip


@pytest.mark.parametrize("policy", sorted(EQUIVALENCE))
def test_decisions_match_cbcore(tiny: Path, policy: str) -> None:
    config = {
        "plugins": [PLUGIN],
        "scheduler": {"budget": LIMITS, **EQUIVALENCE[policy]},
        "kv_cache": {"block_size": 32, "num_blocks": BLOCKS, "prefix_caching": False},
    }
    ref = run_cbcore(tiny, config, trace())
    got = vllm_run(policy)
    assert ref.error is None
    assert [rid for _, rid in got.first_scheduled()] == [rid for _, rid in ref.first_scheduled()]
    assert got.victims() == ref.victims() == []
    report = compare(ref, got, applicable(load(), VERSION, "sync"))
    assert not report.unexplained, [(a.name, a.k, a.cbcore, a.vllm) for a in report.unexplained]


# Async scheduling, same trace: a slot freed by a request finishing in step N is refilled in step N+2 (N+1 was
# planned before N's result), so admissions come later and meet a different set of waiting requests. Orders by
# arrival or by length keep their order; orders by deadline, aged priority or service received change it.
ASYNC_ORDER = {
    "fcfs": "A B C D E F G H",
    "fcfs-static": "A B C D E F G H",
    "sjf": "B C F E D H A G",
    "edf": "D B F G C E A H",  # sync: D B F C G ...: C waits a step longer, and G (deadline 1.1 s) now competes
    "priority-aging": "C B E F H A D G",  # sync: ... A D H G
    "vtc": "A C F B D G E H",  # sync: ... D H E G
}


@pytest.mark.parametrize("policy", sorted(EQUIVALENCE))
def test_async_scheduling_admits_later_and_the_policy_orders_what_waits(policy: str) -> None:
    """docs/vllm.md, async-event-timing: the difference async scheduling makes to the decisions, pinned."""
    sync, asynchronous = vllm_run(policy), vllm_run(policy, async_scheduling=True)
    assert " ".join(rid for _, rid in asynchronous.first_scheduled()) == ASYNC_ORDER[policy]
    same_order = [rid for _, rid in asynchronous.first_scheduled()] == [rid for _, rid in sync.first_scheduled()]
    assert same_order == (policy in ("fcfs", "fcfs-static", "sjf"))
    # The first admission into a freed slot comes a step later than synchronously.
    k_sync = sync.first_scheduled()[2][0]
    assert asynchronous.first_scheduled()[2][0] == k_sync + 1
    assert len(asynchronous.steps) >= len(sync.steps)
    assert asynchronous.victims() == sync.victims() == []
