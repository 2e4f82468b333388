"""The four policies of a cbcore config, built by cbcore's registry and checked against vLLM.

Whatever a policy asks that vLLM 0.32.0's scheduler cannot do is refused here,
at start, with the plugin's name and the reason -- never ignored. What can be
honoured is translated: the prefill policy into vLLM's own chunking knobs.
"""

from __future__ import annotations

from dataclasses import dataclass

from cbcore_vllm._cbcore import (
    SLOTS,
    ChunkedPrefill,
    ConfigError,
    Door,
    EngineConfig,
    LongestPrefixMatch,
    QueuePolicy,
    WholePrompt,
    get_registry,
)


class RefusedPolicy(ConfigError):
    """A configured policy asks for something vLLM's scheduler cannot do; the message says which and why."""


@dataclass(frozen=True)
class Chunking:
    """How vLLM's scheduler is to chunk prefills for the configured prefill policy."""

    enable_chunked_prefill: bool
    long_prefill_token_threshold: int  # 0: no cap beyond the step's token budget


def build(config: EngineConfig) -> Door:
    """One instance per slot, made by cbcore's registry (params validated by each plugin's model)."""
    registry = get_registry(tuple(config.plugins))
    specs = {slot: getattr(config.scheduler, slot) for slot in SLOTS}
    made = {slot: registry.create(slot, s.name, s.params, f"scheduler.{slot}") for slot, s in specs.items()}
    return Door(**made, origins={slot: registry.get(slot, s.name).origin for slot, s in specs.items()})


def refuse_unsupported(p: Door, config: EngineConfig) -> None:
    """Raise :class:`RefusedPolicy` for anything vLLM's scheduler cannot honour exactly."""
    q, pre = p.names[id(p.queue)], p.names[id(p.preemption)]
    preemptive = getattr(p.queue.params, "preempt_running", type(p.queue).outranks is not QueuePolicy.outranks)
    if preemptive:
        raise RefusedPolicy(
            f"{q}: preemptive admission (outranks(): a waiting request evicting running ones) cannot be honoured: "
            "vLLM's scheduler preempts only to let a running request grow, never to admit a waiting one"
            + ("; set preempt_running: false" if "preempt_running" in type(p.queue.params).model_fields else "")
        )
    if isinstance(p.queue, LongestPrefixMatch):
        raise RefusedPolicy(
            f"{q}: its order reads num_cached_prompt_tokens of waiting requests, but vLLM looks a request up "
            "in its prefix cache only when admitting it"
        )
    if p.mode != "recompute":
        raise RefusedPolicy(
            f"{pre}: mode {p.mode!r} cannot be honoured: vLLM's scheduler preempts by recompute only "
            "(its CPU offloading is a KV connector, not a preemption mode); use recompute"
        )
    if config.scheduler.order != "decode-first":
        raise RefusedPolicy(
            f"scheduler.order {config.scheduler.order!r} cannot be honoured: vLLM schedules running requests "
            "before waiting ones in every step (decode-first)"
        )


def chunking(p: Door, max_num_batched_tokens: int, max_model_len: int) -> Chunking:
    """vLLM's chunking for the prefill policy; RefusedPolicy for one it cannot express.

    vLLM sizes each prefill inline (pending tokens, capped by one per-step
    threshold and by the budget); it cannot ask a plugin per request. So only
    the built-ins whose answers that rule reproduces are accepted.
    """
    name = p.names[id(p.prefill)]
    prefill = p.prefill
    if type(prefill) is WholePrompt:
        if max_num_batched_tokens < max_model_len:
            raise RefusedPolicy(
                f"{name}: needs --max-num-batched-tokens >= --max-model-len ({max_num_batched_tokens} < "
                f"{max_model_len}): cbcore runs a prompt longer than the budget alone in its step, vLLM "
                "without chunking never runs it"
            )
        return Chunking(enable_chunked_prefill=False, long_prefill_token_threshold=0)
    if type(prefill) is ChunkedPrefill:
        params = prefill.params
        if params.long_prefill_threshold is not None:
            raise RefusedPolicy(
                f"{name}: long_prefill_threshold/max_long_prefills cannot be honoured: vLLM 0.32.0 caps each "
                "prefill's chunk but does not count long prefills per step"
            )
        chunk = params.chunk_size or 0
        return Chunking(enable_chunked_prefill=True, long_prefill_token_threshold=min(chunk, max_num_batched_tokens))
    raise RefusedPolicy(
        f"{name}: a custom prefill policy cannot decide inside vLLM: its scheduler sizes every prefill "
        "itself (pending tokens capped by --long-prefill-token-threshold and the token budget) and asks no "
        "plugin per request; use chunked-prefill (chunk_size) or whole-prompt"
    )
