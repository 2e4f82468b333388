"""The documented differences (``cbcore_vllm/differences.yaml``) and how each is recognised in a trace.

Each entry's ``signature`` names a function here that looks at the vLLM
side's trace up to a step and returns the evidence that the difference was
at work (or None). The check blames the first step where the two engines'
steps differ on the documented difference at work there (the latest
evidence at or before it); a later divergence of the order or the victims
follows from that step. With no evidence, the divergence is unexplained.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources import files
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict

from cbcore_vllm.check.trace import StepTrace, Trace

Evidence = tuple[int, str] | None  # (the step's k, what was seen there)


class Difference(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    title: str
    vllm: tuple[str, ...]
    scheduling: Literal["sync", "async", "both"]
    signature: str | None
    text: str


def load() -> list[Difference]:
    data = yaml.safe_load(files("cbcore_vllm").joinpath("differences.yaml").read_text())
    out = [Difference.model_validate(entry) for entry in data]
    unknown = {d.signature for d in out} - set(SIGNATURES) - {None}
    if unknown:
        raise ValueError(f"differences.yaml names signatures this module does not know: {sorted(unknown)}")
    return out


def applicable(differences: list[Difference], version: str, scheduling: Literal["sync", "async"]) -> list[Difference]:
    return [d for d in differences if version in d.vllm and d.scheduling in (scheduling, "both")]


def markdown(differences: list[Difference]) -> str:
    """The list as docs/vllm.md shows it."""
    return "".join(
        f"* **{d.title}** (`{d.id}`; vLLM {', '.join(d.vllm)}; {'sync and async' if d.scheduling == 'both' else d.scheduling}"
        f" scheduling). {d.text}\n"
        for d in differences
    )


# -- signatures: (vLLM trace, its steps up to the divergence) -> (step, evidence) of the last sign, or None --


def _prefill_alone(trace: Trace, steps: list[StepTrace]) -> Evidence:
    cap = trace.chunk_threshold
    for s in reversed(steps):
        if cap > 0 and s.eligible == 1 and len(s.scheduled) == 1:
            (rid, n), = s.scheduled.items()
            if n > cap:
                return s.k, f"{rid} alone was given {n} tokens (chunk threshold {cap})"
    return None


def _whole_prompt_reservation(trace: Trace, steps: list[StepTrace]) -> Evidence:
    for s in reversed(steps):
        for r in s.kv_refused:
            return s.k, (f"vLLM kept {r['id']} waiting: its whole prompt needs {r['whole_blocks']} blocks, "
                    f"{r['free_blocks']} were free (its first chunk needed {r['chunk_blocks']})")  # fmt: skip
    return None


def _self_victim(trace: Trace, steps: list[StepTrace]) -> Evidence:
    for s in reversed(steps):
        for victim, asker, after in zip(s.preempted, s.askers, s.waiting_behind, strict=True):
            if victim == asker and after:
                return s.k, f"{victim} asked for a KV block and was its own victim; {after} running after it waited"
    return None


def _running_above_max_num_seqs(trace: Trace, steps: list[StepTrace]) -> Evidence:
    for s in reversed(steps):
        if s.max_num_seqs is not None and s.running is not None and s.running > s.max_num_seqs:
            return s.k, f"{s.running} requests running, the budget's max_num_seqs was {s.max_num_seqs}"
    return None


def _limits_clamped(trace: Trace, steps: list[StepTrace]) -> Evidence:
    for s in reversed(steps):
        if s.clamped:
            return s.k, "the budget's limits exceeded vLLM's --max-num-seqs / --max-num-batched-tokens"
    return None


SIGNATURES: dict[str, Callable[[Trace, list[StepTrace]], Evidence]] = {
    "prefill_alone": _prefill_alone,
    "whole_prompt_reservation": _whole_prompt_reservation,
    "self_victim": _self_victim,
    "running_above_max_num_seqs": _running_above_max_num_seqs,
    "limits_clamped": _limits_clamped,
}


@dataclass(frozen=True)
class Explanation:
    difference: Difference
    evidence: str
    k: int


def explain(differences: list[Difference], vllm_trace: Trace, upto_k: int) -> Explanation | None:
    """The documented difference whose evidence comes last at or before step ``upto_k``, if any.

    Called with the first step where the engines' steps differ, that is the
    difference at work in that very step when there is one.
    """
    steps = [s for s in vllm_trace.steps if s.k <= upto_k]
    found = []
    for d in differences:
        if d.signature is not None and (sign := SIGNATURES[d.signature](vllm_trace, steps)) is not None:
            found.append(Explanation(d, sign[1], sign[0]))
    return max(found, key=lambda e: e.k) if found else None
