"""Many runs through vLLM's offline engine in one process (vLLM's import is the slow part): the tests' driver.

    python -m cbcore_vllm.check.batch SPEC.json OUT.json

SPEC: {"runs": [{"name", "model", "engine": {...EngineArgs...}, "cbcore": {...}, "requests": [...]}]};
OUT: {"results": [{"name", "trace": Trace.to_json(), "startup_s", "run_s", "tokens"}]}.
"""

from __future__ import annotations

import gc
import json
import sys

from cbcore_vllm.check.vllm_engine import run_vllm_engine


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    results = []
    for run in spec["runs"]:
        trace, facts = run_vllm_engine(run["model"], run["engine"], run["cbcore"], run["requests"])
        results.append({"name": run["name"], "trace": trace.to_json(), **facts})
        gc.collect()
    with open(sys.argv[2], "w") as f:
        json.dump({"results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
