"""`cb demo`: the seeds' experiment on the default model, static batching vs continuous batching."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from cbcore.cli.main import CLIError
from cbcore.cli.options_util import build_config, load_model

TEXT_WIDTH = 90


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = sub.add_parser(
        "demo",
        parents=[common],
        help="continuous vs static batching on the seeds' six requests (default model, offline)",
        description="Run the seeds' six requests (token caps 6, 50, 300, 30, 180, 45) on 3 slots, "
        "first with static batching (a new wave only when the whole wave has finished), then with "
        "continuous batching (a free slot is refilled at the next step), and compare.",
    )
    parser.add_argument("--plot", metavar="FILE.png", help="draw both runs' slot timelines here")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cbcore.demo.run import DEMO_REQUESTS, LABELS, SLOTS, demo_scheduler, run_once, warm_up

    plot = check_plot_path(args.plot) if args.plot else None
    configs = {
        kind: build_config(args, {"scheduler": demo_scheduler(kind)}) for kind in ("static", "continuous")
    }
    start = time.perf_counter()
    model, tokenizer = load_model(configs["static"])
    param = next(model.parameters())
    name = configs["static"].model.path or "SmolLM2-135M-Instruct (default)"
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    size = f"{millions:.0f}M" if millions >= 10 else f"{millions:.2f}M"
    print(f"model: {name}, {size} parameters, {param.dtype}, {param.device}; ", end="")
    print(f"loaded in {time.perf_counter() - start:.1f} s; backend: {configs['static'].backend.name}")
    print(f"{len(DEMO_REQUESTS)} requests, {SLOTS} slots, greedy decoding:")
    for label, (prompt, cap) in zip(LABELS, DEMO_REQUESTS, strict=False):
        print(f"  {label}  cap {cap:>3}  {prompt!r}")
    warm_up(model, tokenizer, configs["continuous"])

    print("\n=== static batching: a new wave of 3 starts only when the whole wave has finished ===")
    static = run_once("static", model, tokenizer, configs["static"], on_event=print_event)
    print(f"static batching: {static.wall_s:.2f} s, {static.steps} steps")

    print("\n=== continuous batching: a freed slot is refilled at the next step ===")
    shown: set[str] = set()
    continuous = run_once(
        "continuous",
        model,
        tokenizer,
        configs["continuous"],
        on_event=print_event,
        on_step=lambda record, tracker: print_mask(record, tracker, tokenizer, shown),
    )
    print(f"continuous batching: {continuous.wall_s:.2f} s, {continuous.steps} steps")
    print_summary(static, continuous)
    if plot is not None:
        from cbcore.demo.plot import plot_timelines

        prompts = dict(zip(LABELS, (p for p, _ in DEMO_REQUESTS), strict=False))
        plot_timelines([static, continuous], plot, prompts)
        print(f"slot timeline of both runs: {plot}")
    return 0 if static.tokens() == continuous.tokens() else 1


def check_plot_path(path: str) -> Path:
    """Fail before the runs, not after them, on a path the plot could not be written to."""
    target = Path(path)
    if target.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise CLIError(f"--plot {path}: use a .png, .svg or .pdf file name")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise CLIError(f"cannot write --plot {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise CLIError(f"cannot write --plot {path}: permission denied")
    return target


def one_line(text: str) -> str:
    text = text.replace("\n", "⏎")
    return text if len(text) <= TEXT_WIDTH else text[: TEXT_WIDTH - 3] + "..."


def print_event(event: Any) -> None:
    from cbcore.demo.run import DEMO_REQUESTS, LABELS

    prompt, cap = DEMO_REQUESTS[LABELS.index(event.label)] if event.label else ("", 0)
    where = f"[step {event.step:>3}] slot {event.slot}"
    if event.kind == "admit":
        print(f"++ {where} <- {event.label} (cap {cap}): {prompt!r}", flush=True)
    elif event.kind == "done":
        out = event.output
        n = len(out.output_token_ids)
        text = one_line(prompt + (out.text or ""))
        print(f"-- {where} done {event.label} ({n}/{cap} tokens, {out.finish_reason}): {text}", flush=True)
    elif event.kind == "preempt":
        print(f"!! {where} preempted {event.label}", flush=True)
    else:
        print(f"   {where} stays empty: {', '.join(event.waiting)} wait for the wave to end", flush=True)


def print_mask(record: Any, tracker: Any, tokenizer: Any, shown: set[str]) -> None:
    from cbcore.demo.mask import render_step

    stats = record.stats
    if "prefill" not in shown and stats.num_prefill_tokens and not stats.num_decode_tokens:
        shown.add("prefill")
        title = "the prompts packed together (all prefill)"
    elif "mixed" not in shown and stats.is_mixed:
        shown.add("mixed")
        title = "prefill and decode fused in one forward"
    else:
        return
    print()
    print(render_step(record, tracker.labels, tracker.timeline[-1], tokenizer, title))
    print(flush=True)


def print_summary(static: Any, continuous: Any) -> None:
    from cbcore.demo.run import LABELS

    print("\n=== summary ===")
    for run in (static, continuous):
        total = run.steps * len(run.tracker.slots)
        print(
            f"{run.kind + ':':<12} {run.wall_s:7.2f} s  {run.steps:>4} steps  "
            f"{run.tracker.used_slot_steps}/{total} slot-steps used, "
            f"{run.tracker.idle_while_waiting} left empty while requests waited"
        )
    print(
        f"speed-up: {static.wall_s / continuous.wall_s:.2f}x wall time, "
        f"{static.steps / continuous.steps:.2f}x fewer steps (continuous reuses freed slots at once)"
    )
    widths: dict[int, list[float]] = {}
    for run in (static, continuous):
        for n, times in run.tracker.step_seconds.items():
            widths.setdefault(n, []).extend(times)
    costs = ", ".join(
        f"{n} seq{'s' if n > 1 else ''} {1000 * sum(t) / len(t):.0f} ms" for n, t in sorted(widths.items())
    )
    print(f"mean step time: {costs} (wall time follows the step count as far as wider steps stay cheap)")
    same = [label for label in LABELS if static.tokens().get(label) == continuous.tokens().get(label)]
    if len(same) == len(static.outputs) == len(continuous.outputs):
        print(f"identical tokens: yes, all {len(same)} requests (greedy; packing does not change results)")
    else:
        differ = [label for label in LABELS if label not in same]
        print(f"identical tokens: NO, requests {', '.join(differ)} differ between the two runs")
    first = continuous.outputs.get("A")
    if first is not None:
        print(f"A: The capital of France is{one_line(first.text or '')}")
