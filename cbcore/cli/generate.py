"""`cb generate`: run prompts through the engine; JSONL results, optional live streaming."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from cbcore.cli.main import CLIError
from cbcore.cli.options_util import add_engine_flags, build_config, load_model
from cbcore.cli.requests_util import BadInput, Job, make_job, read_jobs
from cbcore.outputs import RequestOutput


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = sub.add_parser(
        "generate",
        parents=[common],
        help="generate text for prompts given as arguments or in a JSONL file",
        description="Generate text for prompts (arguments, or --input FILE.jsonl with one object per "
        "line: prompt or messages, optional max_new_tokens, temperature, top_k, top_p, seed, "
        "priority, client_id, deadline_s, attrs, request_id). Results are JSONL, one line written and flushed "
        "as each request finishes (so an interrupt keeps every finished result) with the request_id as 'id'.",
    )
    parser.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (repeatable)")
    parser.add_argument("--input", "-i", metavar="FILE", help="JSONL file of requests")
    parser.add_argument("--output", "-o", metavar="FILE", help="write JSONL results here (default: stdout)")
    parser.add_argument(
        "--stream",
        action="store_true",
        help="print text to stdout as it is generated (JSONL then only with --output)",
    )
    parser.add_argument("--chat", action="store_true", help="send PROMPT arguments as chat user messages")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="default per request (64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="default per request (0: greedy)")
    parser.add_argument("--top-k", type=int, help="default top-k for sampled requests")
    parser.add_argument("--top-p", type=float, help="default top-p for sampled requests")
    parser.add_argument("--seed", type=int, help="default seed of each request's generator")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_engine_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    defaults = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    defaults.update({k: v for k in ("top_k", "top_p", "seed") if (v := getattr(args, k)) is not None})
    config = build_config(args)  # a bad --set or --policy fails before anything else
    jobs, bad = collect_jobs(args, defaults)
    for problem in bad:
        report(problem)
    out = open_output(args.output)
    if not jobs:
        if out is not None:
            out.close()
        return 1
    model, tokenizer = load_model(config)
    from cbcore.engine import Engine, RequestError

    engine = Engine(model, tokenizer, config)
    accepted: list[Job] = []
    for job in jobs:
        try:
            ids = job.record.token_ids(tokenizer)
            engine.add_request(
                ids,
                job.params,
                request_id=job.request_id,
                priority=job.record.priority,
                client_id=job.record.client_id,
                deadline_s=job.record.deadline_s,
                attrs=job.record.attrs,
            )
        except (RequestError, ValueError) as exc:
            bad.append(problem := BadInput(job.where, str(exc).splitlines()[0]))
            report(problem)
            continue
        accepted.append(job)
    sink = out if out is not None else (None if args.stream else sys.stdout)
    try:
        results = drive(engine, accepted, tokenizer, args, sink)
    finally:
        if out is not None:
            out.close()
    failed = [r for r in results.values() if r.error is not None]
    for r in failed:
        report(BadInput(f"request {r.request_id}", r.error or "failed"))
    return 1 if bad or failed else 0


def collect_jobs(args: argparse.Namespace, defaults: dict[str, Any]) -> tuple[list[Job], list[BadInput]]:
    if not args.prompts and not args.input:
        raise CLIError("give prompts as arguments or a JSONL file with --input FILE")
    jobs: list[Job] = []
    bad: list[BadInput] = []
    for i, text in enumerate(args.prompts, start=1):
        data = {"messages": [{"role": "user", "content": text}]} if args.chat else {"prompt": text}
        result = make_job(f"argument {i}", f"prompt-{i}", data, defaults)
        (bad if isinstance(result, BadInput) else jobs).append(result)
    if args.input:
        more, more_bad = read_jobs(args.input, defaults)
        taken = {j.request_id for j in jobs}
        for job in more:
            if job.request_id in taken:
                more_bad.append(BadInput(job.where, f"request_id {job.request_id!r} is already used"))
            else:
                jobs.append(job)
        bad.extend(more_bad)
    return jobs, bad


def open_output(path: str | None) -> TextIO | None:
    """Opened before the model loads, so an unwritable path fails in a second, not after the run."""
    if path is None:
        return None
    try:
        return open(path, "w", encoding="utf-8")  # closed after the run
    except OSError as exc:
        raise CLIError(f"cannot write --output {path}: {exc.strerror}") from None


def drive(
    engine: Any, jobs: list[Job], tokenizer: Any, args: argparse.Namespace, sink: TextIO | None
) -> dict[str, RequestOutput]:
    """Step the engine to completion, streaming, counting and writing each result to ``sink`` as it ends."""
    from tqdm import tqdm

    stream = None
    if args.stream:
        from cbcore.cli.stream_util import OrderedStream

        headers = {j.request_id: f"[{j.request_id}] " for j in jobs} if len(jobs) > 1 else {}
        stream = OrderedStream(tokenizer, [j.request_id for j in jobs], headers, sys.stdout)
    quiet = args.no_progress or args.stream or len(jobs) < 2
    bar = tqdm(total=len(jobs), unit="req", desc="generate", file=sys.stderr, disable=True if quiet else None)
    results: dict[str, RequestOutput] = {}
    tokens = 0
    while engine.has_unfinished():
        for output in engine.step():
            tokens += len(output.new_token_ids)
            if stream is not None:
                stream.update(output.request_id, output.new_token_ids, output.finished)
            if output.finished:
                results[output.request_id] = output
                if sink is not None:
                    sink.write(json.dumps(result_record(output), ensure_ascii=False) + "\n")
                    sink.flush()
                bar.update(1)
                bar.set_postfix(tokens=tokens, refresh=False)
    bar.close()
    return results


def result_record(out: RequestOutput) -> dict[str, Any]:
    record: dict[str, Any] = {
        "id": out.request_id,
        "text": out.text,
        "finish_reason": out.finish_reason,
        "prompt_tokens": len(out.prompt_token_ids),
        "output_tokens": len(out.output_token_ids),
        "token_ids": out.output_token_ids,
    }
    metrics = out.metrics
    if metrics is not None:
        record["ttft_s"] = _round(metrics.ttft)
        record["e2e_s"] = _round(metrics.e2e)
    if out.error is not None:
        record["error"] = out.error
    return record


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def report(problem: BadInput) -> None:
    print(f"cb: error: {problem}", file=sys.stderr, flush=True)
