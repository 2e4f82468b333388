"""The per-step cost of two checkouts of cbcore, side by side: scheduling and a decode step, alternated.

Each round runs one child process per checkout (``--a`` then ``--b``, swapped
every other round so neither always goes first), and each child measures, in
its own checkout:

* ``schedule_us``: one ``schedule()`` plus the engine's plan check at 256
  running (decoding) and 1,000 waiting requests, default policies with room
  for 512 sequences and 2,048 tokens a step (median of ``--reps`` fresh
  schedulers);
* ``decode_ms``: the default model's decode step at 16 sequences (the median
  ``StepStats.total_s`` of the steps in which all 16 decode).

Only the APIs both sides share are used (``build_scheduler``, the queues,
``check_plan``, ``Engine.generate``, ``step_listeners``), so a checkout from
before the scheduler merge runs it as is. Each child runs as the ``cb``
application does: a checkout whose library no longer sets the process's
allocator itself gets the application's opt-in
(``cbcore.cli.main.opt_in_process_settings``), so both sides step with the
same allocator behaviour. Usage (each checkout with its own
venv)::

    python scripts/step_ab.py --a /path/to/base/.venv/bin/python --b .venv/bin/python --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, statistics, sys, time
import torch
from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.scheduling.policy_scheduler import build_scheduler
from cbcore.scheduling.sampling_params import SamplingParams as SP
from cbcore.scheduling.sequence import Sequence, SequenceStatus
from cbcore.scheduling.step import check_plan

reps = int(sys.argv[1])
try:  # the allocator setting is the application's opt-in; older checkouts set it in the library
    from cbcore.cli.main import opt_in_process_settings
except ImportError:
    pass
else:
    opt_in_process_settings()
config = EngineConfig.model_validate({"scheduler": {"budget": {
    "name": "token-budget", "max_num_seqs": 512, "max_num_batched_tokens": 2048}}})

def scheduler():
    t = [0.0]
    def clock():
        t[0] += 1e-6
        return t[0]
    sched, _ = build_scheduler(config, 20_000, clock)
    params = SP(max_new_tokens=128)
    for i in range(1256):
        n = 64 + i % 16 if i < 256 else 16 + i % 200
        sched.add(Sequence(f"r{i}", [3 + (i * 7 + j) % 500 for j in range(n)], params, arrival_time=i * 1e-3))
    running, sched.waiting = sched.waiting[:256], sched.waiting[256:]
    for seq in running:
        seq.status = SequenceStatus.RUNNING
        seq.first_scheduled_time = clock()
        sched.blocks.grow(seq, seq.num_prompt_tokens)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.append_token(7, clock())
        sched.running.append(seq)
    return sched

times = []
for _ in range(reps):
    s = scheduler()
    t0 = time.perf_counter()
    out = s.schedule()
    check_plan(out, s.blocks, "ab")
    times.append(time.perf_counter() - t0)
schedule_us = 1e6 * statistics.median(times)

engine = Engine.from_pretrained()
steps = []
engine.step_listeners.append(lambda r: steps.append(r.stats))
prompts = [[3 + (i * 13 + j) % 40000 for j in range(128)] for i in range(16)]
engine.generate(prompts, SamplingParams(max_new_tokens=96, ignore_eos=True))
decode = [s.total_s for s in steps if s.num_seqs == 16 and s.num_prefill_tokens == 0]
print(json.dumps({"schedule_us": schedule_us, "decode_ms": 1e3 * statistics.median(decode[4:])}))
"""


def run(python: str, reps: int) -> dict[str, float]:
    exe = Path(python).absolute()  # <checkout>/.venv/bin/python (not resolved: the venv's link is the point)
    out = subprocess.run([str(exe), "-c", CHILD, str(reps)], cwd=exe.parents[2], capture_output=True, text=True,
                         check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True, help="python of the first checkout's venv (the baseline)")
    parser.add_argument("--b", required=True, help="python of the second checkout's venv")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=15, help="fresh schedulers timed per child")
    args = parser.parse_args(argv)
    rows: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    for r in range(args.rounds):
        for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
            rows[side].append(run(getattr(args, side), args.reps))
            print(f"round {r + 1} {side}: {rows[side][-1]}", file=sys.stderr)
    result = {}
    for metric in ("schedule_us", "decode_ms"):
        a, b = (statistics.median(x[metric] for x in rows[s]) for s in ("a", "b"))
        result[metric] = {"a": a, "b": b, "b_over_a": b / a, "a_rounds": [x[metric] for x in rows["a"]],
                          "b_rounds": [x[metric] for x in rows["b"]]}  # fmt: skip
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
