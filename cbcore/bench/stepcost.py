"""The cost of one decode step: cbcore's engine against HF's batched decode, side by side.

HF's batched decode is ``model(next_ids, past_key_values=DynamicCache)`` on
``width`` rows whose contexts are all ``context`` tokens long (no padding, so
no mask): the forward a padded-batch server runs for every token. cbcore's
step is a whole :meth:`Engine.step` (schedule, pack, forward, sample,
bookkeeping) with ``width`` sequences decoding at the same context.

What a decode step costs does not depend on what the cached keys hold, only
on how many there are, so neither side pays for a real prefill: HF's cache is
filled with random tensors, and cbcore's sequences are brought to their
decode state by steps whose forward is replaced with a stand-in that returns
zero logits (the scheduler, block manager and KV pool run as usual). This
makes a width-64 x 1024-token cell affordable on a small CPU.

Measurements alternate between the two sides (HF, cbcore, HF, cbcore, ...)
so that a change in machine load hits both alike; each side keeps its
median. With one torch thread the clock is the CPU time of the calling
thread (both sides run entirely on it), which other processes on a shared
machine disturb far less than wall time; with more threads it is wall time
(:func:`step_clock`).

A cbcore step is timed the one way cbcore times every step: by the engine
itself, on its clock (:class:`~cbcore.outputs.StepStats`, plan through
commit), the figure ``cb bench`` reports and ``cb profile`` fits;
:func:`timed_steps` adds each step's shape (what the simulator prices).
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from cbcore.config import EngineConfig
from cbcore.engine import Engine
from cbcore.engine_core import EngineCore, Executor, StepRecord
from cbcore.models.loading import KVGeometry
from cbcore.outputs import StepStats
from cbcore.scheduling.plan import Sampled, StepPlan
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.sim.shape import StepShape


@dataclass(frozen=True)
class StepCost:
    """Median seconds per step of each side for one cell of the table."""

    width: int
    context: int
    threads: int
    hf_s: float
    cbcore_s: float
    label: str = "decode"

    @property
    def ratio(self) -> float:
        """cbcore / HF: below 1.0 cbcore's step is cheaper."""
        return self.cbcore_s / self.hf_s


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def random_prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def step_clock(threads: int) -> Callable[[], float]:
    """The clock steps are timed on: the calling thread's CPU time at one thread, else wall time."""
    return time.thread_time if threads == 1 else time.perf_counter


@dataclass(frozen=True)
class TimedStep:
    shape: StepShape  # taken before the step ran
    stats: StepStats  # its seconds: ``stats.total_s``


class _ShapeRecorder:
    """Wraps an engine's executor to note each step's shape before it runs."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.pending: StepShape | None = None

    def prepare(self, plan: StepPlan) -> Any:
        self.pending = StepShape.of(plan)
        return self.inner.prepare(plan)


    def forward(self, prepared: Any) -> Any:
        return self.inner.forward(prepared)

    def sample(self, prepared: Any, forwarded: Any, rng_states: list) -> Sampled:
        return self.inner.sample(prepared, forwarded, rng_states)


@contextlib.contextmanager
def timed_steps(engine: EngineCore) -> Iterator[list[TimedStep]]:
    """Every step that runs a batch in ``engine`` inside the block, with its shape and its time."""
    recorder = _ShapeRecorder(engine.executor)
    steps: list[TimedStep] = []

    def listen(record: StepRecord) -> None:
        if recorder.pending is not None:
            steps.append(TimedStep(recorder.pending, record.stats))
            recorder.pending = None

    engine.executor = recorder
    engine.step_listeners.append(listen)
    try:
        yield steps
    finally:
        engine.executor = recorder.inner
        engine.step_listeners.remove(listen)


class HFDecode:
    """``width`` rows of HF batched decode over a DynamicCache of ``context`` tokens each."""

    def __init__(self, model: PreTrainedModel, width: int, context: int, seed: int = 0) -> None:
        self.model = model
        geometry = KVGeometry.of(model)
        param = next(model.parameters())
        gen = torch.Generator().manual_seed(seed)
        self.cache = DynamicCache(config=model.config)
        shape = (width, geometry.num_kv_heads, context, geometry.head_dim)
        for layer in range(geometry.num_layers):
            k = torch.randn(shape, generator=gen).to(param.device, param.dtype)
            v = torch.randn(shape, generator=gen).to(param.device, param.dtype)
            self.cache.update(k, v, layer)
        vocab = model.config.get_text_config().vocab_size
        self.next_ids = torch.randint(3, vocab, (width, 1), generator=gen).to(param.device)
        self.position = context

    @torch.inference_mode()
    def step(self) -> None:
        width = self.next_ids.shape[0]
        positions = torch.full((width, 1), self.position, device=self.next_ids.device)
        out = self.model(
            input_ids=self.next_ids, position_ids=positions, past_key_values=self.cache, use_cache=True
        )
        self.next_ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        self.position += 1


@dataclass
class PrefillOnly:
    """HF's forward over one prompt alone (the prefill half of a mixed step's fair price).

    Logits only at the last position, as ``generate()`` asks for them.
    """

    model: PreTrainedModel
    prompt: torch.Tensor  # [1, P]

    @torch.inference_mode()
    def step(self) -> None:
        self.model(input_ids=self.prompt, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(dim=-1)


def engine_config(
    width: int, context: int, steps: int, backend: str = "sdpa", forward: str = "auto"
) -> EngineConfig:
    """A roomy pool for ``width`` sequences of ``context + steps`` tokens.

    The token budget takes every prompt in one step, so all sequences start decoding together, at
    exactly ``context`` tokens (with a smaller one, those prefilled first would decode meanwhile
    and could finish before the last one starts).
    """
    block = 16
    blocks = width * (-(-(context + steps + 2) // block)) + 4
    budget = max(512, width * (context + 1))
    return EngineConfig.model_validate(
        {
            "backend": {"name": backend},
            "execution": {"forward": forward},
            # The mixed cell adds the same prompt every step: cached, it would be prefilled only once.
            "kv_cache": {"block_size": block, "num_blocks": blocks, "prefix_caching": False},
            "scheduler": {
                "budget": {
                    "name": "token-budget",
                    "max_num_seqs": max(width, 1),
                    "max_num_batched_tokens": budget,
                }
            },
        }
    )


@contextlib.contextmanager
def _stand_in_forward(engine: Engine) -> Iterator[None]:
    """Replace the model forward with zero logits (for bringing sequences to their decode state)."""
    runner = engine.runner
    real = runner.forward
    vocab = engine.vocab_size

    def forward(batch: object) -> torch.Tensor:
        return torch.zeros((batch.logits_indices.shape[0], vocab), device=runner.device)  # type: ignore[attr-defined]

    runner.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        runner.forward = real  # type: ignore[method-assign]


class EngineDecode:
    """An engine with ``width`` sequences decoding at ``context`` tokens of context."""

    def __init__(
        self,
        model: PreTrainedModel,
        width: int,
        context: int,
        steps: int,
        *,
        backend: str = "sdpa",
        seed: int = 0,
        prefill: int = 0,
        forward: str = "auto",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        seqs = width + 1 if prefill else width  # a mixed step's prompt runs beside the decodes
        config = engine_config(seqs, context + prefill, steps, backend, forward)
        self.engine = Engine(model, None, config, clock=clock)
        rng = random.Random(seed)
        vocab = self.engine.vocab_size
        # Long enough to outlast every timed step (the pool is sized for it), and no longer: a request
        # that could never fit its context or the pool is refused at add_request.
        params = SamplingParams(max_new_tokens=steps + 2, ignore_eos=True)
        for _ in range(width):
            self.engine.add_request(random_prompt(rng, vocab, context), params)
        with _stand_in_forward(self.engine):
            while any(s.is_prefilling for s in _running(self.engine)) or len(_running(self.engine)) < width:
                self.engine.step()
        gen = torch.Generator().manual_seed(seed)
        kv = self.engine.runner.kv_cache
        kv.k.copy_(torch.randn(kv.k.shape, generator=gen).to(kv.k.dtype))
        kv.v.copy_(torch.randn(kv.v.shape, generator=gen).to(kv.v.dtype))
        self.prefill_prompt = random_prompt(rng, vocab, prefill) if prefill else None

    def step(self) -> float:
        """One step; its seconds as the engine timed it."""
        if self.prefill_prompt is not None:  # a mixed step: the decodes plus one whole prompt
            self.engine.add_request(self.prefill_prompt, SamplingParams(max_new_tokens=1))
        self.engine.step()
        return self.engine.step_stats[-1].total_s


def _running(engine: Engine) -> list:
    return list(getattr(engine.scheduler, "running", []))


def timed(step: Callable[[], Any], clock: Callable[[], float]) -> Callable[[], float]:
    """``step`` made to return its seconds on ``clock`` (for the HF side, which has no engine to time it)."""

    def run() -> float:
        t0 = clock()
        step()
        return clock() - t0

    return run


def time_side_by_side(sides: list[Callable[[], float]], rounds: int, steps: int) -> list[float]:
    """Median seconds per step of each side (a side runs one step and returns its seconds); sides
    alternate within every round."""
    for step in sides:  # one untimed call each: first-call costs
        step()
    samples: list[list[float]] = [[] for _ in sides]
    for _ in range(rounds):
        for i, step in enumerate(sides):
            samples[i].append(sum(step() for _ in range(steps)) / steps)
    return [statistics.median(s) for s in samples]


def decode_cell(
    model: PreTrainedModel,
    width: int,
    context: int,
    threads: int,
    *,
    rounds: int = 3,
    steps: int = 3,
    backend: str = "sdpa",
) -> StepCost:
    clock = step_clock(threads)
    with torch_threads(threads):
        hf = HFDecode(model, width, context)
        cb = EngineDecode(model, width, context, (rounds + 1) * steps, backend=backend, clock=clock)
        hf_s, cb_s = time_side_by_side([timed(hf.step, clock), cb.step], rounds, steps)
        del hf, cb
    return StepCost(width, context, threads, hf_s, cb_s)


def forward_cell(
    model: PreTrainedModel, width: int, context: int, threads: int, *, rounds: int = 3, steps: int = 3
) -> StepCost:
    """cbcore's decode step with its fused forward against the same step through HF's modules.

    Both are whole engine steps on the same model; ``hf_s`` is the step with HF's modules.
    """
    clock = step_clock(threads)
    with torch_threads(threads):
        hf = EngineDecode(model, width, context, (rounds + 1) * steps, forward="hf", clock=clock)
        fused = EngineDecode(model, width, context, (rounds + 1) * steps, forward="fused", clock=clock)
        hf_s, fused_s = time_side_by_side([hf.step, fused.step], rounds, steps)
        del hf, fused
    return StepCost(width, context, threads, hf_s, fused_s, label="decode, fused (cbcore) vs HF modules (HF)")


def mixed_cell(
    model: PreTrainedModel,
    width: int,
    context: int,
    prompt_len: int,
    threads: int,
    *,
    rounds: int = 3,
    steps: int = 2,
    backend: str = "sdpa",
) -> StepCost:
    """cbcore's step with ``width`` decodes plus one ``prompt_len`` prefill, against HF's
    decode step plus HF's prefill of the same prompt run separately (their sum)."""
    clock = step_clock(threads)
    with torch_threads(threads):
        hf = HFDecode(model, width, context)
        gen = torch.Generator().manual_seed(1)
        vocab = model.config.get_text_config().vocab_size
        prompt = torch.randint(3, vocab, (1, prompt_len), generator=gen).to(next(model.parameters()).device)
        prefill = PrefillOnly(model, prompt)
        cycles = (rounds + 1) * steps
        cb = EngineDecode(model, width, context, cycles, backend=backend, prefill=prompt_len, clock=clock)
        hf_decode_s, hf_prefill_s, cb_s = time_side_by_side(
            [timed(hf.step, clock), timed(prefill.step, clock), cb.step], rounds, steps
        )
        del hf, cb
    label = f"{width} decodes + prefill {prompt_len}"
    return StepCost(width, context, threads, hf_decode_s + hf_prefill_s, cb_s, label)


def format_table(cells: list[StepCost]) -> str:
    lines = [
        "| step | context | threads | HF ms | cbcore ms | cbcore / HF |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        what = f"{c.label} x{c.width}" if c.label.startswith("decode") else c.label
        lines.append(
            f"| {what} | {c.context} | {c.threads} | {c.hf_s * 1e3:.1f} | {c.cbcore_s * 1e3:.1f} | {c.ratio:.2f} |"
        )
    return "\n".join(lines)
