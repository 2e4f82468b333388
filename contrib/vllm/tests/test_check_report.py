"""The decision check's judgement, on made-up traces (no vLLM needed), and the docs' copy of its list.

What a real run of the check prints is tested at the scheduler level on each
vLLM version (scheduler_level/test_sched_check.py) and is in docs/vllm.md.
"""

from __future__ import annotations

import re
from pathlib import Path

from cbcore_vllm.check.compare import compare, render
from cbcore_vllm.check.differences import applicable, load, markdown
from cbcore_vllm.check.trace import StepTrace, Trace

DOCS = Path(__file__).resolve().parents[3] / "docs" / "vllm.md"


def traces(cb_steps: list[StepTrace], vl_steps: list[StepTrace]) -> tuple[Trace, Trace]:
    ends = {"A": "length", "B": "length", "C": "length", "D": "length"}
    lengths = dict.fromkeys(ends, 2)
    return (Trace("cbcore", cb_steps, dict(lengths), dict(ends)), Trace("vLLM", vl_steps, dict(lengths), dict(ends)))


def test_docs_show_the_documented_differences_as_the_check_reads_them() -> None:
    text = DOCS.read_text()
    section = re.search(r"<!-- differences: begin -->\n(.*?)<!-- differences: end -->", text, re.S)
    assert section is not None, "docs/vllm.md lost its generated list of documented differences"
    assert section.group(1) == markdown(load()), "regenerate it: python -m cbcore_vllm.check --list-differences"


def test_agreeing_traces_report_agreement() -> None:
    steps = [StepTrace(0, {"A": 8, "B": 8}), StepTrace(1, {"A": 1, "B": 1, "C": 4})]
    cb, vl = traces(steps, [StepTrace(s.k, dict(s.scheduled)) for s in steps])
    report = compare(cb, vl, applicable(load(), "0.32.0", "sync"))
    assert all(a.k is None for a in report.aspects)
    assert render(report).endswith("result: the decisions agree")


def test_a_divergence_with_no_documented_cause_is_unexplained() -> None:
    cb, vl = traces(
        [StepTrace(0, {"A": 8}), StepTrace(1, {"B": 8})],
        [StepTrace(0, {"B": 8}, eligible=2, running=0, max_num_seqs=1), StepTrace(1, {"A": 8}, eligible=1)],
    )
    report = compare(cb, vl, applicable(load(), "0.34.0", "sync"))
    assert [a.name for a in report.unexplained] == ["first-scheduled order", "steps"]
    order = report.aspects[0]
    assert (order.k, order.cbcore, order.vllm) == (0, "A B", "B A")
    assert "UNEXPLAINED" in render(report) and render(report).endswith("2 unexplained divergences")


def test_the_step_where_the_runs_part_is_blamed_on_the_difference_at_work_there() -> None:
    # Step 1: a self-victim with nobody behind it (no effect); step 3: vLLM keeps C waiting for its whole prompt.
    cb_steps = [StepTrace(0, {"A": 8, "B": 8}), StepTrace(1, {"A": 1}, ["B"]), StepTrace(2, {"A": 1}),
                StepTrace(3, {"A": 1, "C": 4}), StepTrace(4, {"C": 1, "D": 8})]  # fmt: skip
    vl_steps = [StepTrace(0, {"A": 8, "B": 8}), StepTrace(1, {"A": 1}, ["B"], ["B"], [0]), StepTrace(2, {"A": 1}),
                StepTrace(3, {"A": 1}, kv_refused=[{"id": "C", "whole_blocks": 3, "chunk_blocks": 1, "free_blocks": 2}]),
                StepTrace(4, {"A": 1, "D": 8}), StepTrace(5, {"C": 4})]  # fmt: skip
    report = compare(*traces(cb_steps, vl_steps), applicable(load(), "0.32.0", "sync"))
    order, victims, steps, outputs = report.aspects
    assert steps.k == 3 and steps.explanation is not None
    assert steps.explanation.difference.id == "whole-prompt-reservation" and steps.explanation.k == 3
    assert (order.k, order.cbcore, order.vllm) == (3, "C D", "D C")  # C is first scheduled at 3 in cbcore, 5 in vLLM
    assert order.follows_step == 3 and order.explanation is steps.explanation
    assert victims.k is None and outputs.k is None and not report.unexplained


def test_a_difference_that_does_not_apply_to_this_version_explains_nothing() -> None:
    cb, vl = traces(
        [StepTrace(0, {"A": 1, "B": 1}, ["C"])],
        [StepTrace(0, {"A": 1}, ["C"], ["C"], [1])],  # C was its own victim with B behind it
    )
    assert compare(cb, vl, applicable(load(), "0.32.0", "sync")).aspects[2].explanation.difference.id == (
        "self-victim-ends-loop"
    )
    assert compare(cb, vl, applicable(load(), "0.34.0", "sync")).unexplained  # 0.34: the adapter avoids it
