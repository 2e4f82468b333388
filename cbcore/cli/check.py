"""`cb check`: the output-equivalence regression as a command.

Runs a prompt set through the engine under the given config and through HF
``generate()`` one prompt at a time, and prints one line per request: a match,
or the first divergence with the logit gap there. Exits 1 on a real
divergence, so it can gate a CI job. Add ``--set kv_cache.num_blocks=...`` or
a small token budget to force preemption and chunking.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from cbcore.cli.options_util import add_engine_flags, build_config, load_model
from cbcore.cli.requests_util import BadInput, Job, make_job, read_jobs
from cbcore.config import SLOTS

DEFAULT_CAP = 32
# Varied on purpose: chat and plain prompts, one word to a paragraph, code, non-English text.
DEFAULT_PROMPTS: list[dict[str, Any]] = [
    {"request_id": "chat-france", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"request_id": "one-word", "prompt": "Hello"},
    {"request_id": "story", "prompt": "Once upon a time in a land far away,"},
    {"request_id": "code", "prompt": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'},
    {"request_id": "list", "prompt": "Three tips for writing clear documentation:\n1."},
    {"request_id": "french", "prompt": "La tour Eiffel se trouve à"},
    {
        "request_id": "paragraph",
        "prompt": "Continuous batching keeps an inference server busy: instead of waiting for the "
        "longest request of a batch to finish, the scheduler checks after every step whether a "
        "sequence has ended, frees its slot, and admits the next queued prompt at once. Prompts of "
        "different lengths are packed into one row without padding, and a block-diagonal causal "
        "mask keeps each sequence from attending to the others. In short,",
    },
    {
        "request_id": "chat-system",
        "messages": [
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": "Why is the sky blue?"},
        ],
    },
]


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = sub.add_parser(
        "check",
        parents=[common],
        help="check that the engine's tokens equal per-prompt HF generate() under a config",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    parser.add_argument(
        "--prompts", metavar="FILE", help="JSONL prompt set, as for cb generate (default: a built-in set)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        help=f"cap every request at N tokens (default: the prompt's own cap, else {DEFAULT_CAP})",
    )
    parser.add_argument("--ignore-eos", action="store_true", help="always generate the full cap")
    add_engine_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cbcore.testing.check import run_equivalence

    jobs, bad = collect_jobs(args)
    config = build_config(args)
    for problem in bad:
        print(f"cb: error: {problem}", file=sys.stderr, flush=True)
    if not jobs:
        return 1
    model, tokenizer = load_model(config)
    prompts: list[list[int]] = []
    accepted: list[Job] = []
    for job in jobs:
        try:
            prompts.append(job.record.token_ids(tokenizer))
        except ValueError as exc:
            bad.append(problem := BadInput(job.where, str(exc)))
            print(f"cb: error: {problem}", file=sys.stderr, flush=True)
            continue
        accepted.append(job)
    if not accepted:
        return 1
    print(
        f"checking {len(accepted)} prompts against per-prompt HF generate() ...", file=sys.stderr, flush=True
    )
    report = run_equivalence(
        config,
        model=model,
        tokenizer=tokenizer,
        prompts=prompts,
        max_new_tokens=[j.params.max_new_tokens for j in accepted],
        ignore_eos=args.ignore_eos,
        priorities=[j.record.priority for j in accepted],
        client_ids=[j.record.client_id for j in accepted],
        deadlines_s=[j.record.deadline_s for j in accepted],
        attrs=[j.record.attrs for j in accepted],
    )
    named = [
        dataclasses.replace(c, request_id=j.request_id)
        for c, j in zip(report.comparisons, accepted, strict=True)
    ]
    print(f"config: {describe_config(config)}")
    print(dataclasses.replace(report, comparisons=named).table())
    print(f"engine: {describe_run(report.engine)}")
    return 0 if report.ok and not bad else 1


def collect_jobs(args: argparse.Namespace) -> tuple[list[Job], list[BadInput]]:
    """The prompt set; sampling other than greedy is refused: the contract is about greedy tokens."""
    defaults = {"max_new_tokens": args.max_new_tokens or DEFAULT_CAP}
    if args.prompts:
        jobs, bad = read_jobs(args.prompts, defaults)
    else:
        jobs, bad = [], []
        for i, data in enumerate(DEFAULT_PROMPTS, start=1):
            job = make_job(f"built-in prompt {i}", data["request_id"], data, defaults)
            assert isinstance(job, Job)
            jobs.append(job)
    kept = []
    for job in jobs:
        if not job.params.greedy:
            bad.append(BadInput(job.where, "cb check compares greedy decoding; remove 'temperature'"))
            continue
        if args.max_new_tokens:
            job.params = job.params.model_copy(update={"max_new_tokens": args.max_new_tokens})
        kept.append(job)
    return kept, bad


def describe_config(config: Any) -> str:
    sched = config.scheduler
    if sched.name is not None:
        policies = f"scheduler {sched.name}"
    else:
        policies = "+".join(getattr(sched, slot).name for slot in SLOTS)
    kv = config.kv_cache
    blocks = f"{kv.num_blocks} blocks" if kv.num_blocks else f"{kv.max_memory_mb:g} MiB"
    return f"{policies}; backend {config.backend.name}; kv {blocks} of {kv.block_size}; {config.model.dtype}"


def describe_run(engine: Any) -> str:
    totals = engine.step_totals
    parts = [
        f"{totals.steps} steps",
        f"up to {totals.max_seqs} sequences per step",
        f"{totals.mixed_steps} mixed prefill+decode steps",
    ]
    partial = getattr(engine.scheduler, "num_partial_prefills", None)
    if partial is not None:
        parts.append(f"{partial} partial prefill chunks")
    parts.append(f"{totals.preemptions} preemptions")
    return ", ".join(parts)
