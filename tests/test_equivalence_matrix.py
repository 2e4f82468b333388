"""The equivalence matrix: every backend usable here x every policy mix x four model families.

float32 greedy must be token-exact against HF ``generate()`` on each prompt alone
(a genuine near-tie is the only tolerated difference, and the harness reports
it); float16/bfloat16 runs must agree on the top-5 at the first divergence.
Each run is also checked for having taken the hard paths: the mixes' small KV
cache must force preemption, and prefill must share steps with decodes.

The built-in mixes run on all four families (they differ in what attention
sees: GQA, plain multi-head, one KV head with biases, a sliding window). A mix
that only swaps in an installed contrib queue policy changes which requests
share a step, not the attention shapes, so it runs on Llama alone; that keeps
the matrix near two minutes on a 2-core machine.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from attention_batches import torch_threads
from conftest import CAPS, CLIENTS, PRIORITIES, PROMPTS

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.plugins import get_registry
from cbcore.testing import assert_equivalent, compare_greedy, compare_topk, reference_generate, tiny_model
from cbcore.testing.mixes import POLICY_MIXES, available_mixes

CPU = torch.device("cpu")
FAMILIES = ["llama", "gpt2", "qwen2", "mistral"]
MIXES = available_mixes()
BACKENDS = sorted(e.name for e in get_registry().entries("backend") if e.cls.unavailable_reason(CPU) is None)
MATRIX = [
    pytest.param(backend, mix, family, id=f"{backend}-{mix}-{family}")
    for backend in BACKENDS
    for mix in MIXES
    for family in (FAMILIES if mix in POLICY_MIXES else ["llama"])
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def run(model: torch.nn.Module, backend: str, mix: dict[str, Any], logprobs: int | None = None):
    config = EngineConfig.model_validate({**mix, "backend": {"name": backend}})
    engine = Engine(model, config=config)
    params = [SamplingParams(max_new_tokens=c, logprobs=logprobs) for c in CAPS]
    outputs = engine.generate(PROMPTS, params, priorities=PRIORITIES, client_ids=CLIENTS)
    return engine, outputs


def check_hard_paths(engine: Engine, mix: dict[str, Any]) -> None:
    assert engine.scheduler.num_preemptions > 0, "the small KV cache should have forced preemption"
    # A static budget admits a new wave only when the batch is done, so it need not mix.
    if mix["scheduler"]["budget"]["name"] != "static":
        assert any(s.is_mixed for s in engine.step_stats), "no step carried prefill and decode together"


@pytest.mark.parametrize(("backend", "mix", "family"), MATRIX)
def test_float32_greedy_is_token_exact(models, references, backend, mix, family):
    model = models[family]
    engine, outputs = run(model, backend, MIXES[mix])
    assert_equivalent(compare_greedy(model, outputs, references[family]))
    check_hard_paths(engine, MIXES[mix])


def _cpu_runs(dtype: torch.dtype) -> bool:
    try:
        torch.ones(2, 2, dtype=dtype) @ torch.ones(2, 2, dtype=dtype)
    except RuntimeError:
        return False
    return True


@functools.cache
def half_reference(family: str, dtype: torch.dtype):
    model = tiny_model(family, dtype=dtype)
    return model, reference_generate(model, PROMPTS, CAPS, top_logprobs=5)


HALF_MIX = "priority+chunked+swap"
HALF_CASES = [
    pytest.param(torch.bfloat16, "mistral", id="bf16-mistral"),
    pytest.param(
        torch.float16,
        "llama",
        id="fp16-llama",
        marks=pytest.mark.skipif(not _cpu_runs(torch.float16), reason="this CPU build has no fp16 matmul"),
    ),
]


@pytest.mark.parametrize(("dtype", "family"), HALF_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision_agrees_on_the_top5(backend, dtype, family):
    model, references = half_reference(family, dtype)
    engine, outputs = run(model, backend, MIXES[HALF_MIX], logprobs=5)
    assert_equivalent(compare_topk(outputs, references))
    check_hard_paths(engine, MIXES[HALF_MIX])


def test_the_matrix_covers_the_fast_and_the_reference_backend():
    assert {"eager", "sdpa"} <= set(BACKENDS)
    if torch.cuda.is_available():  # flash-varlen is exercised by its own CUDA tests
        return
    assert "flash-varlen" not in BACKENDS
