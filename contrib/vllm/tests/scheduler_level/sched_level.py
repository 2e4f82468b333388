"""Shared pieces of the scheduler-level tests: they run in each vLLM venv (``make test-vllm-sched``).

vLLM's real scheduler class with ``cbcore_vllm.Scheduler`` on top, built from a
``VllmConfig`` and driven with fake model outputs by ``cbcore_vllm.harness``
(which must be imported before anything else of vLLM: it sets vLLM's platform).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import cbcore_vllm.harness as harness  # before vLLM's modules (sorted first): it sets vLLM's platform
import torch
import vllm
from cbcore_vllm.check.trace import Trace, Tracer
from cbcore_vllm.check.vllm_scheduler import record

# cbcore's engine runs a tiny model here (the reference side): threads would only fight over the cores,
# as tests/conftest.py says for the main suite.
torch.set_num_threads(1)

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))  # vllm_trace: the multi-tenant trace the end-to-end tests use too

PLUGIN = str(TESTS / "plugins" / "recorder.py")
VERSION = vllm.__version__
# 0.32.0 takes vLLM's fcfs victim path, which ends its running loop when the asker is its own victim.
SELF_VICTIM_ENDS_LOOP = VERSION == "0.32.0"


def expected_version() -> str | None:
    """The version `make test-vllm-sched` says this venv holds."""
    return os.environ.get("CBCORE_VLLM_EXPECT")


def events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def drive(
    cbcore: dict[str, Any],
    requests: list[dict[str, Any]],
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_blocks: int = 200,
    max_model_len: int = 256,
    async_scheduling: bool = False,
) -> tuple[harness.Driver, Trace]:
    """The requests through vLLM's scheduler with the adapter; the driver (calls, outputs) and the decisions."""
    scheduler = harness.build_scheduler(
        cbcore,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        async_scheduling=async_scheduling,
    )
    scheduler.tracer = tracer = Tracer()
    driver = harness.Driver(scheduler)
    driver.run(requests, before_step=lambda k: setattr(tracer, "k", k))
    return driver, record(Trace(engine=f"vLLM {VERSION}"), driver, tracer)
