"""The efficiencies of the shipped Hopper roofline profiles, fitted to published H100 timings.

Prices the four linear products of one Llama-2-7B layer with the roofline
(:func:`cbcore.sim.anchor.check_linear`) against Vidur's H100 measurements, at
the data-sheet peaks and with the (FLOP/s, bandwidth) efficiencies that
minimise the mean relative error, for both roofline forms (the larger of
compute and memory time, and their sum); prints the errors as JSON
(docs/simulate.md, "Checked against published H100 timings")::

    .venv/bin/python scripts/fit_roofline.py tests/data/h100-llama-2-7b-linear.csv
"""

from __future__ import annotations

import json
import sys

from cbcore.sim.anchor import LLAMA_2_7B, check_linear, fit_efficiencies, load_linear
from cbcore.sim.roofline import Hardware

# Data-sheet numbers of the H100 SXM: dense BF16 tensor-core FLOP/s, HBM3 bandwidth.
H100_SXM = Hardware(name="NVIDIA H100 SXM", peak_flops=989e12, mem_bandwidth=3.35e12)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: scripts/fit_roofline.py LINEAR_TIMINGS.csv", file=sys.stderr)
        return 2
    timings = load_linear(argv[0])
    report = {}
    for overlap in (True, False):
        hw = H100_SXM.model_copy(update={"overlap": overlap})
        nominal = hw.model_copy(update={"flops_efficiency": 1.0, "bandwidth_efficiency": 1.0})
        fitted = fit_efficiencies(hw, LLAMA_2_7B, timings)
        report["max" if overlap else "sum"] = {
            "peaks": check_linear(nominal, LLAMA_2_7B, timings),
            "fitted": {
                "flops_efficiency": fitted.flops_efficiency,
                "bandwidth_efficiency": fitted.bandwidth_efficiency,
                **check_linear(fitted, LLAMA_2_7B, timings),
            },
        }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
