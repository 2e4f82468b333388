"""Per-step statistics: what was packed and where the time went."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepStats:
    step: int
    num_seqs: int
    num_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    kv_blocks_used: int
    kv_blocks_total: int
    schedule_s: float  # the scheduler's decision
    prepare_s: float  # swaps and packing the FlatBatch
    forward_s: float  # the model forward (attention included)
    sample_s: float  # sampling, stop checks, bookkeeping, outputs
    # Prefix cache: tokens of the prompts admitted this step, and how many of them the cache held.
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.forward_s + self.sample_s

    @property
    def overhead_s(self) -> float:
        """Everything that is not the model forward."""
        return self.total_s - self.forward_s

    @property
    def is_mixed(self) -> bool:
        """Prefill and decode tokens shared this step's forward."""
        return self.num_prefill_tokens > 0 and self.num_decode_tokens > 0


@dataclass(frozen=True)
class EngineLoad:
    """How busy an engine is right now: what ``/metrics``, routers and benchmarks read.

    A snapshot taken between steps, so it is consistent with itself. Schedulers
    that keep no waiting/running/swapped lists report 0 for those counts.
    """

    num_waiting: int
    num_running: int
    num_swapped: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions_total: int
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0

    @property
    def kv_usage(self) -> float:
        """Share of the device KV pool in use (0.0 to 1.0)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass
class StepTotals:
    """Running aggregates over every step an engine ran (constant size, unlike a list of steps)."""

    steps: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    mixed_steps: int = 0
    preemptions: int = 0
    max_seqs: int = 0
    seconds: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("schedule", "prepare", "forward", "sample"), 0.0)
    )

    def add(self, s: StepStats) -> None:
        self.steps += 1
        self.tokens += s.num_tokens
        self.prefill_tokens += s.num_prefill_tokens
        self.decode_tokens += s.num_decode_tokens
        self.mixed_steps += s.is_mixed
        self.preemptions += s.num_preempted
        self.max_seqs = max(self.max_seqs, s.num_seqs)
        sec = self.seconds
        sec["schedule"] += s.schedule_s
        sec["prepare"] += s.prepare_s
        sec["forward"] += s.forward_s
        sec["sample"] += s.sample_s
