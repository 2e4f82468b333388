"""vLLM's real scheduler, on a machine that cannot run vLLM's model: built from a VllmConfig, fed fake outputs.

What vLLM's own scheduler tests (``tests/v1/core``) do: build a ``VllmConfig``
and a ``KVCacheConfig`` by hand, construct the scheduler class, add
``Request``\\ s, and answer each ``schedule()`` with a ``ModelRunnerOutput``
holding a sampled token per request that finished its prompt. The scheduler
is pure Python; nothing runs a model. This is how the adapter is tested on
the official vLLM wheels (GPU builds), and how ``python -m cbcore_vllm.check
--vllm scheduler`` runs anywhere.

A ``VllmConfig`` needs a platform, and vLLM's own does not fit here: 0.34's
``CpuPlatform.check_and_update_config`` refuses an x86 CPU without
``triton-cpu`` (not on the package index), and vLLM's CPU platform turns
async scheduling off. So importing this module installs
:class:`SchedulerOnlyPlatform` -- vLLM's CPU platform with a config step that
changes nothing -- as vLLM's current platform. Import it before any other
vLLM module reads the platform; a process that runs vLLM's real engine must
not import it.

Steps mirror vLLM's engine core: synchronous, ``schedule()`` then
``update_from_output()`` of the same step (``EngineCore.step``); async, its
batch queue of two (``EngineCore.step_with_batch_queue``): step N+1 is
scheduled before step N's output is handed back.
"""

from __future__ import annotations

import tempfile
from collections import deque
from pathlib import Path
from typing import Any

import vllm
import vllm.platforms
from vllm.platforms.cpu import CpuPlatform


class SchedulerOnlyPlatform(CpuPlatform):
    """vLLM's CPU platform for building a scheduler: its config step leaves the config as given."""

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        return None


if vllm.platforms._current_platform is not None and not isinstance(
    vllm.platforms._current_platform, SchedulerOnlyPlatform
):
    raise RuntimeError(
        "cbcore_vllm.harness must be imported before vLLM resolves its platform "
        f"(already {type(vllm.platforms._current_platform).__name__})"
    )
vllm.platforms._current_platform = SchedulerOnlyPlatform()

import torch  # noqa: E402  (after the platform: vLLM modules read it when imported)
from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from cbcore_vllm.check.model import tiny_llama_config  # noqa: E402
from cbcore_vllm.shim import for_version  # noqa: E402

_MODEL_DIR: list[Path] = []


def model_dir() -> Path:
    """A tiny Llama's config (no weights: nothing runs it), written once per process."""
    if not _MODEL_DIR:
        _MODEL_DIR.append(tiny_llama_config(Path(tempfile.mkdtemp(prefix="cbcore-vllm-harness-"))))
    return _MODEL_DIR[0]


def build_scheduler(
    cbcore: dict[str, Any],
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_blocks: int,
    block_size: int = 32,
    max_model_len: int = 256,
    async_scheduling: bool = False,
    scheduler_cls: str | None = "cbcore_vllm.Scheduler",
) -> Any:
    """The scheduler class vLLM would build for these flags; ``num_blocks`` usable KV blocks (plus vLLM's null one)."""
    model = ModelConfig(model=str(model_dir()), skip_tokenizer_init=True, dtype="float32", max_model_len=max_model_len)
    vllm_config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
            async_scheduling=async_scheduling,
            scheduler_cls=scheduler_cls,
        ),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=False),
        additional_config={"cbcore": cbcore},
    )
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float32)
    kv_config = KVCacheConfig(
        num_blocks=num_blocks + 1, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks + 1
    cls = vllm_config.scheduler_config.get_scheduler_cls()
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=False,
    )


def make_request(r: dict[str, Any]) -> Request:
    """A vLLM request from the driver's form: {"id", "prompt", "max_tokens", "priority", "xargs"}."""
    params = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True, extra_args=r.get("xargs"))
    return Request(r["id"], list(r["prompt"]), params, None, priority=r.get("priority", 0))


class Driver:
    """Steps a scheduler as vLLM's engine core does, answering every step with fake sampled tokens."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.async_scheduling = bool(scheduler.scheduler_config.async_scheduling)
        self._internals = for_version(vllm.__version__, allow_untested=True)
        self.in_flight: deque[tuple[Any, Any]] = deque()  # (scheduler output, runner output), newest first
        self.calls: list[tuple[str, int]] = []  # ("schedule", n) / ("update", n): the order vLLM's calls came in
        self.outputs: list[Any] = []  # every EngineCoreOutput, in order
        self._n = 0

    def add(self, r: dict[str, Any]) -> None:
        self.scheduler.add_request(make_request(r))

    def _schedule(self) -> tuple[Any, Any]:
        self._n += 1
        out = self.scheduler.schedule()
        self.calls.append(("schedule", self._n))
        # Sampled now, as a model runner would: a request whose prompt is done this step samples a token.
        sampled = {
            rid: ([] if self.scheduler.requests[rid].is_prefill_chunk else [3 + (self._n + i) % 400])
            for i, rid in enumerate(out.num_scheduled_tokens)
        }
        return out, (self._n, self._internals.runner_output(sampled))

    def _update(self, out: Any, run: tuple[int, Any]) -> None:
        n, runner_output = run
        self.calls.append(("update", n))
        for engine_outputs in self.scheduler.update_from_output(out, runner_output).values():
            self.outputs.extend(engine_outputs.outputs)

    def step(self) -> None:
        """One iteration of vLLM's engine-core loop."""
        s = self.scheduler
        if not self.async_scheduling:
            if s.has_requests():
                self._update(*self._schedule())
            return
        if s.has_requests():
            out, run = self._schedule()
            self.in_flight.appendleft((out, run))
            if len(self.in_flight) < 2 and (out.total_num_scheduled_tokens > 0 or s.has_requests()):
                return
        elif not self.in_flight:
            return
        self._update(*self.in_flight.pop())

    def busy(self) -> bool:
        return bool(self.in_flight) or self.scheduler.has_requests()

    def run(self, requests: list[dict[str, Any]], before_step: Any = None, max_iterations: int = 100_000) -> None:
        """Add each request before iteration ``arrive`` and step until every request has finished."""
        pending = sorted(requests, key=lambda r: r.get("arrive", 0))
        for k in range(max_iterations):
            if before_step is not None:
                before_step(k)
            while pending and pending[0].get("arrive", 0) <= k:
                self.add(pending.pop(0))
            self.step()
            if not pending and not self.busy():
                return
        raise RuntimeError(f"requests still unfinished after {max_iterations} iterations")

    def finished(self) -> dict[str, Any]:
        """request id -> its final EngineCoreOutput."""
        return {o.request_id: o for o in self.outputs if o.finish_reason is not None}
