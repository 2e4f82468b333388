"""Derive the GPU operator tables that ship in ``cbcore/sim/gpu/data`` from Vidur's published CSVs.

Usage: build_gpu_tables.py VIDUR_DIR [OUT.json.gz]

``VIDUR_DIR`` holds Vidur's ``compute/GPU__ORG__MODEL__mlp.csv`` and
``network/CLUSTER__all_reduce.csv`` files (microsoft/vidur at commit
7d47513363ec447a741ac5e47241580b47724fbf, MIT licence). What is kept, and why:

* compute: the **median** of each operator's repeated timings (ms), by
  tensor-parallel degree and token count. Where a (degree, token count) pair
  was measured twice (2,048 and 4,096 tokens, and the powers of two of the
  Llama-3 tables), the two medians are averaged. The other statistics (min,
  max, mean, std) and the model-shape columns are dropped: the shapes are in
  :mod:`cbcore.sim.gpu.catalog`.
* network: the median all-reduce time by message size (bytes) for the
  single-node rows only (``devices_per_node == num_workers``: tensor
  parallelism inside one machine), which is what Vidur itself prices tensor
  parallelism with. The multi-node rows and the send/recv tables are not used
  (pipeline parallelism is not simulated) and not shipped.

Times are rounded to 1e-6 ms, below the tables' own resolution (1e-3 ms, or
half of it for a median of an even count), so nothing is lost.
"""

from __future__ import annotations

import csv
import gzip
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

# Vidur's file names -> the catalogue's model keys (cbcore.sim.gpu.catalog.MODELS).
MODEL_FILES = {
    "meta-llama__Llama-2-7b-hf": "llama-2-7b",
    "meta-llama__Llama-2-70b-hf": "llama-2-70b",
    "meta-llama__Meta-Llama-3-8B": "llama-3-8b",
    "meta-llama__Meta-Llama-3-70B": "llama-3-70b",
    "codellama__CodeLlama-34b-Instruct-hf": "codellama-34b",
    "internlm__internlm-20b": "internlm-20b",
    "Qwen__Qwen-72B": "qwen-72b",
    "microsoft__phi-2": "phi-2",
}
SOURCE = "microsoft/vidur@7d47513363ec447a741ac5e47241580b47724fbf"


def _ms(value: float) -> float:
    return round(value, 6)


def compute_tables(path: Path) -> dict[str, dict[str, object]]:
    """{tp: {"tokens": [...], "ops": {operator: [ms, ...]}}} of one GPU x model file."""
    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    ops = [k[len("time_stats.") : -len(".median")] for k in rows[0] if k.endswith(".median")]
    cells: dict[int, dict[int, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for row in rows:
        tp, tokens = int(row["num_tensor_parallel_workers"]), int(row["num_tokens"])
        for op in ops:
            cells[tp][tokens][op].append(float(row[f"time_stats.{op}.median"]))
    out: dict[str, dict[str, object]] = {}
    for tp in sorted(cells):
        tokens = sorted(cells[tp])
        out[str(tp)] = {
            "tokens": tokens,
            "ops": {op: [_ms(statistics.fmean(cells[tp][t][op])) for t in tokens] for op in ops},
        }
    return out


def network_tables(path: Path) -> dict[str, dict[str, list[float]]]:
    """{workers: {"bytes": [...], "ms": [...]}} of one cluster's all-reduce file (single-node rows)."""
    cells: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    with path.open(newline="") as fh:
        for row in csv.DictReader(fh):
            workers = int(row["num_workers"])
            if row["collective"] != "all_reduce" or int(row["devices_per_node"]) != workers:
                continue
            cells[workers][int(row["size"])].append(float(row["time_stats.all_reduce.median"]))
    return {
        str(w): {
            "bytes": sorted(cells[w]),
            "ms": [_ms(statistics.fmean(cells[w][b])) for b in sorted(cells[w])],
        }
        for w in sorted(cells)
    }


def build(vidur: Path) -> dict[str, object]:
    compute: dict[str, object] = {}
    for path in sorted((vidur / "compute").glob("*__mlp.csv")):
        gpu, org, name, _ = path.name.split("__")
        model = MODEL_FILES.get(f"{org}__{name}")
        if model is None:
            raise SystemExit(f"{path.name}: no catalogue entry for model {org}/{name}")
        compute[f"{gpu}/{model}"] = compute_tables(path)
    network = {
        path.name.split("__")[0]: network_tables(path) for path in sorted((vidur / "network").glob("*__all_reduce.csv"))
    }
    return {
        "source": SOURCE,
        "units": "milliseconds, median of the repeated timings; all-reduce message sizes in bytes",
        "compute": compute,
        "network": network,
    }


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__.splitlines()[2], file=sys.stderr)
        return 2
    out = Path(argv[1]) if len(argv) == 2 else Path(__file__).parents[1] / "cbcore/sim/gpu/data/vidur-tables.json.gz"
    data = json.dumps(build(Path(argv[0])), separators=(",", ":"), sort_keys=True).encode()
    # mtime=0: the same tables give the same bytes, so a rebuild shows no spurious change.
    out.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
    print(f"{out}: {out.stat().st_size:,} bytes ({len(data):,} uncompressed)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
