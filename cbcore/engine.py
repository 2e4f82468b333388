"""Engine: requests in, one packed forward per step, output deltas out."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedModel

from cbcore.config import EngineConfig
from cbcore.engine_core import EngineCore, Prompt, RequestError, StepRecord, build_scheduler
from cbcore.execution.runner import ModelRunner, plan_num_blocks
from cbcore.models.loading import KVGeometry, check_model, eos_token_ids
from cbcore.plugins import get_registry

__all__ = ["Engine", "Prompt", "RequestError", "StepRecord"]


class Engine(EngineCore):
    """Continuous batching over one HF causal LM.

    Every :meth:`step` asks the scheduler what runs, packs all of it (prefill
    chunks and decode tokens of every sequence) into one row, runs the model
    once, samples one token per sequence that finished its pending tokens, and
    reports the deltas. The loop itself is :class:`EngineCore`'s, shared with
    the simulator.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any | None = None,
        config: EngineConfig | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        config = config if config is not None else EngineConfig()
        max_model_len = check_model(model, config.model)
        registry = get_registry(tuple(config.plugins))
        backend = registry.create("backend", config.backend.name, config.backend.params, "backend")
        num_blocks = plan_num_blocks(config.kv_cache, KVGeometry.of(model), next(model.parameters()).dtype)
        scheduler, names = build_scheduler(config, num_blocks, clock)
        host_blocks = scheduler.blocks.num_host_blocks
        execution = config.execution
        self.runner = ModelRunner(
            model, backend, config.kv_cache.block_size, num_blocks, host_blocks, execution.linear, execution.forward
        )
        self.model = model
        super().__init__(config, self.runner, scheduler, vocab_size=model.config.get_text_config().vocab_size,
                         max_model_len=max_model_len, names=names, eos_token_ids=eos_token_ids(model),
                         tokenizer=tokenizer, clock=clock)  # fmt: skip

    @classmethod
    def from_pretrained(cls, path: str | None = None, config: EngineConfig | None = None) -> Engine:
        """Load a model directory or hub id (``config.model`` says dtype and device)."""
        from cbcore.models.loading import load_model_and_tokenizer

        config = config if config is not None else EngineConfig()
        model, tokenizer = load_model_and_tokenizer(path or config.model.path, config.model)
        return cls(model, tokenizer, config)

