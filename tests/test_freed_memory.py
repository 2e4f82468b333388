"""The CPU engine keeps the pages a step frees for the next step (``hold_freed_memory``)."""

from __future__ import annotations

import sys

import pytest
from script_processes import last_line_of_each

# Page faults per step of alike prefills, not seconds: the same on a loaded machine. "returned" is
# the control: the same engine with glibc's defaults (else this test would prove nothing here).
SCRIPT = """
import resource, sys
import cbcore.execution.runner as runner
from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.testing.tiny_models import random_prompts, tiny_model
if sys.argv[1] == "returned":
    runner.hold_freed_memory = lambda: "off for the control"
config = EngineConfig.model_validate({"scheduler": {"budget": {"name": "token-budget", "max_num_seqs": 8,
                                      "max_num_batched_tokens": 2048}}, "kv_cache": {"prefix_caching": False}})
engine = Engine(tiny_model("llama"), config=config)
faults = []
engine.step_listeners.append(lambda record: faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt))
for _ in range(6):
    engine.generate(random_prompts(8, 256, 256, seed=1), SamplingParams(max_new_tokens=1, ignore_eos=True))
per_step = [b - a for a, b in zip(faults, faults[1:])]
print(sorted(per_step[2:])[1])  # the median step: any one step may also grow Python's own heap
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_steps_freed_activations_serve_the_next_step_without_page_faults():
    (held,), (returned,) = last_line_of_each(SCRIPT, "held", "returned")
    assert returned > 200  # glibc's defaults: each prefill of 2,048 tokens (one row piece) maps fresh pages
    assert held < returned // 10, f"{held} page faults a step with freed memory held, {returned} without"
