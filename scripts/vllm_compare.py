"""Does the ranking of policies found in cbcore hold in vLLM? One trace, four policies, three engines.

For each policy (fcfs, priority, vtc, edf; none of them evicting running requests
to admit a waiting one, which vLLM cannot do) the same ``scheduler:`` section runs

* in cbcore's engine:           ``cb bench --config POLICY.yaml ...`` (in process);
* in cbcore's simulator:        ``cb simulate --profile PROFILE --config POLICY.yaml ...``;
* in vLLM with the adapter:     vLLM's OpenAI server with ``--scheduler-cls cbcore_vllm.Scheduler``
                                and that section as ``--additional-config``, driven by
                                ``cb bench --server URL`` with the same trace,

and it prints per-class TTFT p99 and deadline attainment side by side (markdown).
Run from the repository root after ``make setup vllm-setup``::

    .venv/bin/python scripts/vllm_compare.py --out /tmp/compare [--profile here.json]

Without ``--profile`` it measures one with ``cb profile --quick`` first. The
servers run one after another on loopback, each alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "contrib" / "vllm" / "tests"))
from vllm_helpers import free_port, server_command, server_env, stop_server, wait_healthy  # noqa: E402

CB = str(ROOT / ".venv" / "bin" / "cb")
WORKLOAD = (
    "poisson:n=48,rate=2,lengths=fixed,input_len=64,output_len=32,clients=alice:3/bob:1,"
    "priorities=0:1/1:3,deadlines=0:6/1:30,seed=0"
)
BUDGET = {"name": "token-budget", "max_num_seqs": 4, "max_num_batched_tokens": 256}
PREFILL = {"name": "chunked-prefill", "chunk_size": 64}
QUEUES = {
    "fcfs": {"name": "fcfs"},
    "priority": {"name": "priority", "preempt_running": False},
    "vtc": {"name": "vtc", "preempt_running": False},
    "edf": {"name": "edf", "preempt_running": False},
}


def scheduler(queue: dict[str, Any]) -> dict[str, Any]:
    return {"queue": queue, "budget": BUDGET, "prefill": PREFILL, "preemption": {"name": "recompute"}}


def run(cmd: list[str], log: Path) -> None:
    print("+", " ".join(cmd), flush=True)
    with log.open("a") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)


def cbcore_rows(out: Path, configs: dict[str, Path], profile: Path) -> None:
    flags = [x for path in configs.values() for x in ("--config", str(path))]
    common = ["--workload", WORKLOAD, "--no-progress", *flags]
    if not reused(out / "cbcore.json"):
        run([CB, "bench", *common, "--threads", "2", "--repeat", "2", "--no-reference", "--json", str(out / "cbcore.json")], out / "log.txt")
    run([CB, "simulate", "--profile", str(profile), *common, "--json", str(out / "sim.json")], out / "log.txt")


def reused(path: Path) -> bool:
    """An earlier run's result in --out is kept (delete it to measure again); said, not silent."""
    if path.exists():
        print(f"reusing {path}", flush=True)
    return path.exists()


def vllm_rows(out: Path, model: Path) -> None:
    for name, queue in QUEUES.items():
        if reused(out / f"vllm-{name}.json"):
            continue
        port = free_port()
        log = out / f"vllm-{name}.log"
        cmd = server_command(model, port, {"scheduler": scheduler(queue)}, "--scheduling-policy", "priority",
                             "--max-num-seqs", str(BUDGET["max_num_seqs"]),
                             "--max-num-batched-tokens", str(BUDGET["max_num_batched_tokens"]))  # fmt: skip
        with log.open("w") as f:
            proc = subprocess.Popen(cmd, env=server_env(), stdout=f, stderr=subprocess.STDOUT, text=True)
        try:
            started = wait_healthy(proc, port, log)
            print(f"vLLM with {name} healthy after {started:.0f} s", flush=True)
            run([CB, "bench", "--workload", WORKLOAD, "--server", f"http://127.0.0.1:{port}", "--no-reference",
                 "--no-progress", "--json", str(out / f"vllm-{name}.json")], out / "log.txt")  # fmt: skip
        finally:
            stop_server(proc)


def per_class(row: dict[str, Any]) -> dict[str, tuple[float | None, float | None]]:
    classes = (row.get("classes") or {}).get("priority") or {}
    return {label: (s.get("ttft_p99_s"), s.get("deadline_attainment")) for label, s in classes.items()}


def table(out: Path) -> str:
    engines: dict[str, dict[str, dict[str, Any]]] = {"cb bench": {}, "cb simulate": {}, "vLLM + adapter": {}}
    for key, file in (("cb bench", "cbcore.json"), ("cb simulate", "sim.json")):
        rows = json.loads((out / file).read_text())["rows"]
        for name, row in zip(QUEUES, rows, strict=True):
            engines[key][name] = row
    for name in QUEUES:
        rows = json.loads((out / f"vllm-{name}.json").read_text())["rows"]
        [row] = [r for r in rows if str(r["name"]).startswith("http:")]
        engines["vLLM + adapter"][name] = row
    lines = [
        "| policy | engine | out tok/s | TTFT p99 prio 0 (s) | TTFT p99 prio 1 (s) | deadline met prio 0 "
        "| deadline met prio 1 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name in QUEUES:
        for engine, rows in engines.items():
            c = per_class(rows[name])
            tput = rows[name].get("output_tokens_per_s")
            cells = ["-" if tput is None else f"{tput:.1f}"]
            for i in (0, 1):
                ttft = c.get(str(i), (None, None))[0]
                cells.append("-" if ttft is None else f"{ttft:.2f}")
            for i in (0, 1):
                met = c.get(str(i), (None, None))[1]
                cells.append("-" if met is None else f"{100 * met:.0f} %")
            lines.append(f"| {name} | {engine} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--profile", type=Path, help="a cb profile of this machine (default: measure one, --quick)")
    parser.add_argument("--skip", choices=["cbcore", "vllm"], action="append", default=[])
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    configs = {}
    for name, queue in QUEUES.items():
        configs[name] = out / f"{name}.yaml"
        configs[name].write_text(yaml.safe_dump({"scheduler": scheduler(queue)}))
    from cbcore.models.default_model import default_model_dir

    model = default_model_dir()
    t0 = time.monotonic()
    profile = args.profile
    if profile is None and "cbcore" not in args.skip:
        profile = out / "profile.json"
        if not reused(profile):
            run([CB, "profile", "--quick", "--force", "--threads", "2", "--out", str(profile)], out / "log.txt")
    if "cbcore" not in args.skip:
        cbcore_rows(out, configs, profile)
    if "vllm" not in args.skip:
        vllm_rows(out, model)
    print(f"\nworkload {WORKLOAD}; budget {BUDGET}; prefill {PREFILL}; {time.monotonic() - t0:.0f} s\n")
    print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
