"""Named policy mixes for the equivalence tests, sized to force the hard paths.

With 16 prompts of 1–64 tokens and caps up to 96, a KV cache of 48 blocks of 4
(192 tokens) holds any single request (at most 160 tokens) but never several
long ones at once, so preemption must happen; token budgets of 32–48 make
prefill chunks and decodes share steps.
"""

from __future__ import annotations

from typing import Any

from cbcore.plugins import get_registry

SMALL_KV = {"block_size": 4, "num_blocks": 48}

POLICY_MIXES: dict[str, dict[str, Any]] = {
    "fcfs+token-budget+recompute": {
        "scheduler": {
            "queue": {"name": "fcfs"},
            "budget": {"name": "token-budget", "max_num_seqs": 6, "max_num_batched_tokens": 48},
            "prefill": {"name": "chunked-prefill"},
            "preemption": {"name": "recompute", "victim": "newest"},
        },
        "kv_cache": SMALL_KV,
    },
    "priority+chunked+swap": {
        "scheduler": {
            "queue": {"name": "priority", "aging_s": 30.0},
            "budget": {"name": "token-budget", "max_num_seqs": 8, "max_num_batched_tokens": 32},
            "prefill": {"name": "chunked-prefill", "chunk_size": 16, "long_prefill_threshold": 24},
            "preemption": {"name": "swap", "victim": "lowest-priority"},
        },
        "kv_cache": SMALL_KV,
    },
    "static+whole-prompt": {
        "scheduler": {
            "queue": {"name": "fcfs"},
            "budget": {"name": "static", "max_num_seqs": 4, "max_num_batched_tokens": 96},
            "prefill": {"name": "whole-prompt"},
            "preemption": {"name": "recompute"},
        },
        "kv_cache": SMALL_KV,
    },
    "prefill-first+least-progress": {
        "scheduler": {
            "queue": {"name": "fcfs"},
            "budget": {"name": "token-budget", "max_num_seqs": 5, "max_num_batched_tokens": 40},
            "prefill": {"name": "whole-prompt"},
            "order": "prefill-first",
            "preemption": {"name": "recompute", "victim": "least-progress"},
        },
        "kv_cache": SMALL_KV,
    },
}

# Mixes whose policies read the prefix cache; with prompts that share no prefix they behave
# like their FCFS counterparts, so the matrix runs them on shared-prefix prompts in every family.
CACHE_AWARE_MIXES: dict[str, dict[str, Any]] = {
    "lpm+chunked+recompute": {
        "scheduler": {
            "queue": {"name": "lpm"},
            "budget": {"name": "token-budget", "max_num_seqs": 6, "max_num_batched_tokens": 40},
            "prefill": {"name": "chunked-prefill", "chunk_size": 12},
            "preemption": {"name": "recompute", "victim": "queue-order"},
        },
        "kv_cache": SMALL_KV,
    },
}

# Third-party queue policies (contrib/), mixed in when they are installed.
CONTRIB_QUEUES: dict[str, dict[str, Any]] = {
    "sjf": {"name": "sjf"},
    "vtc": {"name": "vtc"},
    "mlfq": {"name": "mlfq"},
}


def available_mixes() -> dict[str, dict[str, Any]]:
    """The built-in mixes (cache-aware ones included) plus one per installed contrib queue policy."""
    mixes = {**POLICY_MIXES, **CACHE_AWARE_MIXES}
    known = set(get_registry().names("queue"))
    base = POLICY_MIXES["fcfs+token-budget+recompute"]
    for name, queue in CONTRIB_QUEUES.items():
        if name in known:
            mixes[f"{name}+token-budget+recompute"] = {
                **base,
                "scheduler": {**base["scheduler"], "queue": queue},
            }
    return mixes
