"""Decode step time of cbcore and of vLLM's CPU build for the same shapes, measured the same way.

For ``W`` sequences decoding at once at ``C`` tokens of context, each engine
generates ``W`` random ``C``-token prompts twice, once with ``--short`` and once
with ``--long`` new tokens (greedy, EOS ignored, prefix caching off); the
difference of the two wall times over the difference of the token counts is
the time of one decode step of width ``W`` (prefill, start-up and the first
steps cancel out). A prefill cell ``W x C`` (``--prefills``) is the wall time
of generating one token for ``W`` fresh ``C``-token prompts, the same call on
both sides (median of three), which is the prefill step and the requests'
intake around it. cbcore's side times its steps directly instead: the median
of the steps in which all ``W`` sequences decode (``StepStats.total_s``:
schedule, pack, forward, sample), since on this engine the difference of two
wall times carried the noise of two prefills of ``W x C`` tokens (one cell
came out at 4 ms a step, a tenth of its neighbours). Both engines are offline and synchronous: cbcore's
``Engine.generate`` and vLLM's ``LLM.generate`` (compiled, its default), one
engine per side for all cells (a batch limit of the widest cell, so ``W``
prompts decode together), one engine process at a time, sides alternating
between rounds; each cell keeps the median.

Run from the repository root after ``make setup vllm-setup``::

    .venv/bin/python scripts/step_vs_vllm.py --widths 1,4,16,64 --contexts 128,1024 --rounds 2

The vLLM side runs in ``.venv-vllm`` (this file, with ``--side vllm``) in the
environment its CPU docs advise (libiomp preloaded, threads bound).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prompts(width: int, context: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(context)] for _ in range(width)]


def _timed(generate, ps: list, short: int, long: int) -> float:
    """Seconds per decode step: the difference of two runs over the difference of their lengths."""
    generate(ps[:1], 2)  # warm: first-call costs of this shape
    times = {}
    for n in (short, long):
        t0 = time.perf_counter()
        generate(ps, n)
        times[n] = time.perf_counter() - t0
    return (times[long] - times[short]) / (long - short)


def _prefilled(generate, cells: list[tuple[int, int]], vocab: int, wrap=list) -> dict[str, float]:
    """Seconds to generate one token for each prefill cell's prompts: median of three fresh sets."""
    out = {}
    for w, c in cells:
        generate(wrap(prompts(w, c, vocab, 1)), 1)  # warm: first-call costs of this shape
        walls = []
        for seed in range(2, 5):
            ps = wrap(prompts(w, c, vocab, w * 7919 + c + seed))
            t0 = time.perf_counter()
            generate(ps, 1)
            walls.append(time.perf_counter() - t0)
        out[f"prefill:{w}x{c}"] = statistics.median(walls)
    return out


def cbcore_side(
    model_dir: str, cells: list[tuple[int, int]], short: int, long: int, prefills: list[tuple[int, int]]
) -> dict[str, float]:
    from cbcore import Engine, EngineConfig, SamplingParams
    from cbcore.cli.main import opt_in_process_settings

    opt_in_process_settings()  # as `cb serve` runs: freed memory kept for the next step
    width, context = max(w for w, _ in cells), max(c for _, c in cells)
    config = EngineConfig.model_validate(
        {
            "model": {"path": model_dir, "dtype": "float32", "max_model_len": context + long + 8},
            "scheduler": {"budget": {"name": "token-budget", "max_num_seqs": width,
                                     "max_num_batched_tokens": max(2048, context + width)}},
            "kv_cache": {"max_memory_mb": 4096, "prefix_caching": False},
        }
    )
    engine = Engine.from_pretrained(model_dir, config)
    steps: list[float] = []
    width_now = [0]

    def record(step) -> None:  # a step of the cell's shape: every sequence decoding, no prefill
        stats = step.stats
        if stats.num_decode_tokens == width_now[0] and stats.num_prefill_tokens == 0:
            steps.append(stats.total_s)

    engine.step_listeners.append(record)

    def timed(ps: list) -> float:
        engine.generate(ps[:1], SamplingParams(max_new_tokens=2))  # warm: first-call costs of this shape
        steps.clear()
        width_now[0] = len(ps)
        engine.generate(ps, SamplingParams(max_new_tokens=long, ignore_eos=True))
        width_now[0] = 0
        return statistics.median(steps)

    decodes = {f"{w}x{c}": timed(prompts(w, c, engine.vocab_size, w * 7919 + c)) for w, c in cells}

    def generate(ps: list, n: int) -> None:
        engine.generate(ps, SamplingParams(max_new_tokens=n, ignore_eos=True))

    return decodes | _prefilled(generate, prefills, engine.vocab_size)


def vllm_side(
    model_dir: str, cells: list[tuple[int, int]], short: int, long: int, prefills: list[tuple[int, int]]
) -> dict[str, float]:
    from vllm import LLM, SamplingParams, TokensPrompt

    width, context = max(w for w, _ in cells), max(c for _, c in cells)
    llm = LLM(
        model=model_dir,
        dtype="float32",
        max_num_seqs=width,
        max_model_len=context + long + 8,
        max_num_batched_tokens=max(2048, context + width),
        enable_prefix_caching=False,
        block_size=32,
    )
    vocab = llm.llm_engine.model_config.get_vocab_size()

    def generate(ps: list, n: int) -> None:
        llm.generate(ps, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0), use_tqdm=False)

    def wrap(ps: list) -> list:
        return [TokensPrompt(prompt_token_ids=p) for p in ps]

    decodes = {f"{w}x{c}": _timed(generate, wrap(prompts(w, c, vocab, w * 7919 + c)), short, long) for w, c in cells}
    return decodes | _prefilled(generate, prefills, vocab, wrap)


def run_side(side: str, args: argparse.Namespace) -> dict[str, float]:
    """One side in a fresh process (vLLM in its own venv), its cells as JSON."""
    sys.path.insert(0, str(ROOT / "contrib" / "vllm" / "tests"))
    from vllm_helpers import VLLM_PY, vllm_env

    py = str(VLLM_PY) if side == "vllm" else str(ROOT / ".venv" / "bin" / "python")
    cmd = [py, __file__, "--side", side, "--model", args.model, "--widths", args.widths,
           "--contexts", args.contexts, "--short", str(args.short), "--long", str(args.long),
           "--prefills", args.prefills]
    env = vllm_env() if side == "vllm" else None
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{side} side failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side", choices=["cbcore", "vllm"], help="internal: run one side here")
    ap.add_argument("--model", default=None, help="model directory (default: cbcore's embedded default)")
    ap.add_argument("--widths", default="1,4,16,64")
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prefills", default="16x128", help="prefill cells WxC, comma-separated ('' for none)")
    args = ap.parse_args()
    cells = [(int(w), int(c)) for c in args.contexts.split(",") for w in args.widths.split(",")]
    cells_given = [cell.split("x") for cell in args.prefills.split(",") if cell]
    if not all(len(c) == 2 and all(n.isdigit() and int(n) > 0 for n in c) for c in cells_given):
        ap.error(f"--prefills {args.prefills!r}: expected cells like 16x128, comma-separated")
    prefills = [(int(w), int(c)) for w, c in cells_given]
    if args.side:
        fn = vllm_side if args.side == "vllm" else cbcore_side
        print(json.dumps(fn(args.model, cells, args.short, args.long, prefills)))
        return
    if args.model is None:
        from cbcore.models.default_model import default_model_dir

        args.model = str(default_model_dir())
    samples: dict[str, dict[str, list[float]]] = {"cbcore": {}, "vllm": {}}
    for r in range(args.rounds):
        for side in ("vllm", "cbcore") if r % 2 == 0 else ("cbcore", "vllm"):
            for cell, s in run_side(side, args).items():
                samples[side].setdefault(cell, []).append(s)
            print(f"round {r + 1}: {side} done", file=sys.stderr, flush=True)
    print("| decodes | context | vLLM ms/step | cbcore ms/step | cbcore / vLLM |")
    print("|---:|---:|---:|---:|---:|")
    for width, context in cells:
        cell = f"{width}x{context}"
        v, c = statistics.median(samples["vllm"][cell]), statistics.median(samples["cbcore"][cell])
        print(f"| {width} | {context} | {v * 1e3:.1f} | {c * 1e3:.1f} | {c / v:.2f} |")
    for width, context in prefills:
        cell = f"prefill:{width}x{context}"
        v, c = statistics.median(samples["vllm"][cell]), statistics.median(samples["cbcore"][cell])
        print(f"| prefill {width} x {context} | | {v * 1e3:.1f} | {c * 1e3:.1f} | {c / v:.2f} |")


if __name__ == "__main__":
    main()
