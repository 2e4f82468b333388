"""An engine's scheduling state as plain data, read through public attributes only.

Tests of the step transaction compare this before a step that is undone
and after it: equal means the engine is exactly where it was, whatever the
internals that got it there. It reads the scheduler's queues
(``waiting``, ``running``, ``swapped``), each request through
``scheduler.get``, and the block manager's public counters and queries,
including which prefixes the cache would serve (a lookup of a fresh
sequence, which takes nothing from the cache).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cbcore import SamplingParams
from cbcore.scheduling.sequence import Sequence as Seq

PROBE_ID = "engine-state-probe"


def engine_state(engine: Any, prompts: Mapping[str, Sequence[int]] | None = None) -> dict[str, Any]:
    """Everything a step may change and a later step depends on, keyed by what it is.

    ``prompts``: named token lists (the requests' prompts, say) whose cached
    prefix to report as ``cached_tokens["prompt NAME"]``; each live request's
    own tokens are probed too (``"tokens RID"``), with one token more so that
    its last full block counts (a lookup never serves a sequence's last token).
    """
    sched = engine.scheduler
    blocks = sched.blocks
    queues = {
        name: [s.request_id for s in getattr(sched, name)] for name in ("waiting", "running", "swapped")
    }
    requests = {}
    for rid in sorted(r for ids in queues.values() for r in ids):
        seq = sched.get(rid)
        assert seq is not None, f"{rid!r} is queued but scheduler.get() does not know it"
        requests[rid] = {
            "status": seq.status.value,
            "num_computed_tokens": seq.num_computed_tokens,
            "block_table": list(seq.block_table),
            "token_ids": list(seq.token_ids),
            "first_scheduled_time": seq.first_scheduled_time,
            "first_token_time": seq.first_token_time,
            "num_preemptions": seq.num_preemptions,
            "host_blocks": list(blocks.host_blocks_of(seq)),
        }
    probes = {f"prompt {name}": list(p) for name, p in (prompts or {}).items()}
    probes.update({f"tokens {rid}": r["token_ids"] + [0] for rid, r in requests.items()})
    return {
        "queues": queues,
        "requests": requests,
        "blocks": {
            "num_free_blocks": blocks.num_free_blocks,
            "num_used_blocks": blocks.num_used_blocks,
            "num_cached_blocks": blocks.num_cached_blocks,
            "num_free_host_blocks": blocks.num_free_host_blocks,
            "ref_counts": [blocks.ref_count(b) for b in range(blocks.num_blocks)],
            "prefix_cache_queries_tokens": blocks.prefix_cache_queries_tokens,
            "prefix_cache_hits_tokens": blocks.prefix_cache_hits_tokens,
        },
        "cached_tokens": {name: cached_tokens(blocks, t) for name, t in probes.items()},
    }


def cached_tokens(blocks: Any, token_ids: Sequence[int]) -> int:
    """How many leading tokens of ``token_ids`` the prefix cache would serve now (takes nothing)."""
    return blocks.lookup(Seq(PROBE_ID, list(token_ids), SamplingParams()))


def differences(before: dict[str, Any], after: dict[str, Any], path: str = "") -> list[str]:
    """Where two states differ, as ``path: before != after`` lines (for a readable assertion)."""
    if isinstance(before, dict) and isinstance(after, dict):
        keys = sorted(before.keys() | after.keys(), key=str)
        return [
            d
            for k in keys
            for d in differences(before.get(k), after.get(k), f"{path}.{k}" if path else str(k))
        ]
    return [] if before == after else [f"{path}: {before!r} != {after!r}"]


def assert_same_state(before: dict[str, Any], after: dict[str, Any]) -> None:
    diff = differences(before, after)
    assert not diff, "the engine's state changed:\n" + "\n".join(diff)
