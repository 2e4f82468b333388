"""The equivalence matrix: every backend usable here x every policy mix x four model families.

Prefix caching is on (the default) throughout; a second set of prompts that
share stems and earlier turns makes cache hits land mid-chunk, makes recompute
preemption evict sequences that share blocks (and then find their own KV
again), and makes swap preemption copy out shared blocks.

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
from support import CAPS, CLIENTS, PRIORITIES, PROMPTS
from support.attention_batches import torch_threads

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.plugins import get_registry
from cbcore.testing import (
    assert_equivalent,
    compare_greedy,
    compare_topk,
    reference_generate,
    shared_prefix_prompts,
    tiny_model,
)
from cbcore.testing.block_invariants import check_blocks
from cbcore.testing.mixes import CACHE_AWARE_MIXES, POLICY_MIXES, available_mixes

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
        assert engine.step_totals.mixed_steps > 0, "no step carried prefill and decode together"


@pytest.mark.parametrize(("backend", "mix", "family"), MATRIX)
def test_float32_greedy_is_token_exact(models, references, backend, mix, family):
    model = models[family]
    engine, outputs = run(model, backend, MIXES[mix])
    assert_equivalent(compare_greedy(model, outputs, references[family]))
    check_hard_paths(engine, MIXES[mix])


# Prompts that share stems and earlier turns, so prefix-cache hits happen at assorted offsets.
PREFIX_PROMPTS = shared_prefix_prompts(12, seed=0)
PREFIX_CAPS = [30, 4, 45, 12, 60, 8, 25, 50, 3, 40, 20, 35]
PREFIX_MATRIX = [
    pytest.param(backend, mix, family, id=f"{backend}-{mix}-{family}")
    for backend in BACKENDS
    for mix in [*POLICY_MIXES, *CACHE_AWARE_MIXES]
    for family in FAMILIES
]


@functools.cache
def prefix_reference(family: str):
    return reference_generate(tiny_model(family), PREFIX_PROMPTS, PREFIX_CAPS)


class CacheProbe:
    """Watches one engine's scheduler for the prefix-cache paths the matrix must take."""

    def __init__(self, engine: Engine) -> None:
        self.events = dict.fromkeys(("mid_chunk", "shared_recompute", "shared_swap", "own_prefix"), 0)
        sched, blocks = engine.scheduler, engine.scheduler.blocks
        preempt, schedule, record = sched._preempt, sched.schedule, blocks.record_lookup

        def watch_preempt(victim):
            if any(blocks.ref_count(b) > 1 for b in victim.block_table):
                swaps = sched.door.mode == "swap" and blocks.can_swap_out(victim)
                self.events["shared_swap" if swaps else "shared_recompute"] += 1
            return preempt(victim)

        def watch_schedule():
            out = schedule()
            for item in out.scheduled:  # a first chunk that starts at the cached offset and stops short
                seq = item.seq
                start = seq.num_computed_tokens
                if start and start == seq.num_cached_prompt_tokens and start + item.num_tokens < seq.num_tokens:
                    self.events["mid_chunk"] += 1
            return out

        def watch_record(seq, hit):
            if hit and seq.num_preemptions:
                self.events["own_prefix"] += 1  # a recomputed sequence found (part of) its own KV
            return record(seq, hit)

        sched._preempt, sched.schedule, blocks.record_lookup = watch_preempt, watch_schedule, watch_record


@pytest.mark.parametrize(("backend", "mix", "family"), PREFIX_MATRIX)
def test_float32_greedy_with_prefix_cache_hits_is_token_exact(models, backend, mix, family):
    model = models[family]
    config = EngineConfig.model_validate({**MIXES[mix], "backend": {"name": backend}})
    assert config.kv_cache.prefix_caching, "prefix caching should be on by default"
    engine = Engine(model, config=config)
    probe = CacheProbe(engine)
    outputs = engine.generate(PREFIX_PROMPTS, [SamplingParams(max_new_tokens=c) for c in PREFIX_CAPS])
    assert_equivalent(compare_greedy(model, outputs, prefix_reference(family)))
    blocks, events = engine.scheduler.blocks, probe.events
    check_blocks(blocks, [])
    assert blocks.prefix_cache_hits_tokens > 0
    scheduler = MIXES[mix]["scheduler"]
    if scheduler["prefill"]["name"] == "chunked-prefill":
        assert events["mid_chunk"] > 0, events
    if scheduler["budget"]["name"] != "static":  # the others preempt sequences that share blocks
        shared = "shared_swap" if scheduler["preemption"]["name"] == "swap" else "shared_recompute"
        assert events[shared] > 0, events
        if shared == "shared_recompute":
            assert events["own_prefix"] > 0, events


KINDS = [
    (family, forward, linear)
    for family in FAMILIES
    for forward, linear in (("fused", "onednn"), ("fused", "standard"), ("hf", "standard"))
    if forward == "hf" or family != "gpt2"  # the fused forward covers the Llama family
]


@pytest.mark.parametrize(("family", "forward", "layout"), KINDS)
def test_float32_greedy_is_token_exact_with_either_forward_and_linear_kind(models, references, family, forward, layout):
    """The fused forward (the default for the Llama family) and oneDNN's packed products (the CPU
    default) sum in another order than HF's modules and F.linear; the tokens stay."""
    model = models[family]
    mix = MIXES["priority+chunked+swap"]
    config = EngineConfig.model_validate(
        {**mix, "backend": {"name": "sdpa"}, "execution": {"linear": layout, "forward": forward}}
    )
    engine = Engine(model, config=config)
    assert (engine.runner.model_forward, engine.runner.linear) == (forward, layout)
    outputs = engine.generate(PROMPTS, [SamplingParams(max_new_tokens=c) for c in CAPS])
    assert_equivalent(compare_greedy(model, outputs, references[family]))


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
