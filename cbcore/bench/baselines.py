"""Outside baselines on the same requests: HF static padded batches, and transformers' own
continuous batching.

Both honour arrivals in wall time like the engine driver, report tokens the
way the engine does (the EOS token included, cut at the request's cap), and
take their per-token timestamps from where the tokens become available:

* ``hf-static`` — ``model.generate`` on left-padded waves of up to
  ``batch_size`` requests that have arrived; a wave decodes until its longest
  request is done, and nobody joins until the wave ends (the batch barrier).
  Token times come from a streamer, i.e. as if each token were streamed out
  when its step ends; a request's e2e is its last useful token, not the end
  of its wave (the most favourable reading for this baseline).
* ``hf-generate-batch`` — the manager behind ``model.generate_batch``
  (transformers' paged continuous batching), fed request by request so that
  per-request caps and arrival times can be honoured (``generate_batch``
  itself takes one cap and no arrival times); token times are its own
  recorded timestamps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import torch

from cbcore.bench.arrivals import Arrivals, prompt_bounds
from cbcore.bench.driver import ProgressFactory, RunResult, no_progress
from cbcore.bench.workload import BenchRequest, Workload
from cbcore.models.loading import eos_token_ids
from cbcore.outputs import RequestMetrics, RequestOutput

BASELINES = ("hf-static", "hf-generate-batch", "seed-toy")  # seed-toy: cbcore.bench.seed_toy


def cut(tokens: Seq[int], req: BenchRequest, eos: Seq[int]) -> tuple[list[int], str]:
    """What the engine would have returned: up to the cap, through the first EOS unless ignored."""
    out = list(tokens[: req.max_new_tokens])
    if not req.ignore_eos:
        for i, tok in enumerate(out):
            if tok in eos:
                return out[: i + 1], "stop"
    return out, "length"


def baseline_output(
    req: BenchRequest,
    prompt: Seq[int],
    tokens: list[int],
    reason: str,
    arrival: float,
    started: float | None,
    times: Seq[float],
) -> RequestOutput:
    times = tuple(times[: len(tokens)])
    metrics = RequestMetrics(
        arrival_time=arrival,
        first_scheduled_time=started,
        first_token_time=times[0] if times else None,
        token_times=times,
        finish_time=times[-1] if times else started,
        num_preemptions=0,
        prompt_len=len(prompt),
        output_len=len(tokens),
    )
    return RequestOutput(
        request_id=req.request_id,
        prompt_token_ids=list(prompt),
        output_token_ids=tokens,
        new_token_ids=[],
        finished=True,
        finish_reason=reason,
        metrics=metrics,
    )


class _StepTimes:
    """A ``generate`` streamer that only notes when each step's tokens were ready."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first hands over the prompt itself
            self._prompt_seen = True
            return
        self.times.append(self.clock())

    def end(self) -> None: ...


def _pad_id(model: torch.nn.Module, eos: Seq[int]) -> int:
    pad = getattr(model.generation_config, "pad_token_id", None)
    if isinstance(pad, int):
        return pad
    return eos[0] if eos else 0


@torch.inference_mode()
def run_hf_static(
    model: torch.nn.Module,
    workload: Workload,
    token_ids: Seq[Seq[int]],
    *,
    batch_size: int,
    progress: ProgressFactory = no_progress,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> RunResult:
    from transformers import GenerationConfig

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    requests = workload.requests
    eos = list(eos_token_ids(model))
    pad = _pad_id(model, eos)
    device = next(model.parameters()).device
    outputs: dict[int, RequestOutput] = {}
    bar = progress(len(requests), "hf-static")
    queue: list[int] = []
    idle = 0.0
    waves = 0
    warm = torch.tensor([list(token_ids[0][:8])] * 2, device=device)
    model.generate(
        warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False, pad_token_id=pad
    )
    start = clock()
    arrivals = Arrivals(requests, start, token_ids)
    while len(outputs) < len(requests):
        queue.extend(arrivals.due(clock()))
        if not queue:
            idle += arrivals.wait(clock, sleep)
            continue
        wave, queue = queue[:batch_size], queue[batch_size:]
        prompts = {i: arrivals.prompt(i) for i in wave}
        width = max(len(prompts[i]) for i in wave)
        ids = torch.full((len(wave), width), pad, dtype=torch.long)
        mask = torch.zeros((len(wave), width), dtype=torch.long)
        for row, i in enumerate(wave):
            n = len(prompts[i])
            ids[row, width - n :] = torch.tensor(prompts[i])
            mask[row, width - n :] = 1
        respect_eos = not any(requests[i].ignore_eos for i in wave)
        config = GenerationConfig(
            max_new_tokens=max(requests[i].max_new_tokens for i in wave),
            do_sample=False,
            # None would be filled in from the model's generation config; -1 never matches.
            eos_token_id=eos if respect_eos and eos else -1,
            pad_token_id=pad,
        )
        steps = _StepTimes(clock)
        began = clock()
        seqs = model.generate(
            ids.to(device), attention_mask=mask.to(device), generation_config=config, streamer=steps
        )
        waves += 1
        for row, i in enumerate(wave):
            req = requests[i]
            tokens, reason = cut(seqs[row, width:].tolist(), req, eos)
            arrival = arrivals.arrival_time(i)
            outputs[i] = baseline_output(req, prompts[i], tokens, reason, arrival, began, steps.times)
            arrivals.finished(i, outputs[i], clock())
            bar.update(1)
    duration = clock() - start
    bar.close()
    return RunResult(
        name="hf-static",
        kind="baseline",
        outputs=[outputs[i] for i in range(len(requests))],
        duration_s=duration,
        busy_s=duration - idle,
        info={"batch_size": batch_size, "waves": waves},
    )


@torch.inference_mode()
def run_hf_generate_batch(
    model: torch.nn.Module,
    workload: Workload,
    token_ids: Seq[Seq[int]],
    *,
    batch_size: int,
    batch_tokens: int = 512,
    progress: ProgressFactory = no_progress,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> RunResult:
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    requests = workload.requests
    eos = list(eos_token_ids(model))
    config = GenerationConfig(
        max_new_tokens=max(r.max_new_tokens for r in requests),
        do_sample=False,
        eos_token_id=eos or -1,
        pad_token_id=_pad_id(model, eos),
    )
    bounds = prompt_bounds(requests, token_ids)
    hints = WorkloadHints(
        max_prompt_length=max(bounds),
        max_generated_length=config.max_new_tokens,
        num_requests=len(requests),
    )
    # Sized for this workload like the engine (every request resident at once, the same
    # tokens per step); left to itself it sizes its static tensors from the machine's memory,
    # which takes minutes to initialise on a CPU.
    page = ContinuousBatchingConfig.page_size
    pages = sum(-(-(n + r.max_new_tokens) // page) for n, r in zip(bounds, requests, strict=True))
    cb_config = ContinuousBatchingConfig(
        max_requests_per_batch=batch_size, max_batch_tokens=batch_tokens, num_blocks=pages + batch_size
    )
    index = {r.request_id: i for i, r in enumerate(requests)}
    outputs: dict[int, RequestOutput] = {}
    bar = progress(len(requests), "hf-generate-batch")
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb_config, workload_hints=hints, block=True
    ) as manager:
        manager.add_request(list(token_ids[0][:8]), request_id="warm-up", max_new_tokens=4)
        while manager.get_result(request_id="warm-up", timeout=1.0) is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped during warm-up")
        start = clock()
        arrivals = Arrivals(requests, start, token_ids)
        while len(outputs) < len(requests):
            for i in arrivals.due(clock()):
                req = requests[i]
                manager.add_request(
                    arrivals.prompt(i),
                    request_id=req.request_id,
                    max_new_tokens=req.max_new_tokens,
                    record_timestamps=True,
                    eos_token_id=-1 if req.ignore_eos else None,
                )
            at = arrivals.next_time()
            timeout = max(0.0, at - clock()) if at is not None else 1.0
            result = manager.get_result(timeout=timeout)
            if result is not None and result.is_finished():
                i = index[result.request_id]
                prompt, arrival = arrivals.prompt(i), arrivals.arrival_time(i)
                outputs[i] = _generate_batch_output(result, requests[i], prompt, arrival, eos)
                arrivals.finished(i, outputs[i], clock())
                bar.update(1)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped unexpectedly")
        duration = clock() - start
    bar.close()
    return RunResult(
        name="hf-generate-batch",
        kind="baseline",
        outputs=[outputs[i] for i in range(len(requests))],
        duration_s=duration,
        info={"batch_size": batch_size, "max_batch_tokens": batch_tokens},
    )


def _generate_batch_output(
    result: Any, req: BenchRequest, prompt: list[int], arrival: float, eos: Seq[int]
) -> RequestOutput:
    from transformers.generation.continuous_batching.requests import RequestStatus

    if result.status == RequestStatus.FAILED or result.error is not None:
        return RequestOutput.rejected(req.request_id, prompt, str(result.error))
    tokens, reason = cut(result.generated_tokens, req, eos)
    started = result.lifespan[0] if result.lifespan[0] > 0 else None
    return baseline_output(req, prompt, tokens, reason, arrival, started, result.timestamps or [])
