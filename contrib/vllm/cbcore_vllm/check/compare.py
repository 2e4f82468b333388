"""Two traces side by side: where the decisions agree, where they part, and which documented difference explains it.

Four aspects, each compared up to its first divergence (after it, the two
runs are in different states and later differences follow from the first):

* first-scheduled order -- the request ids in the order each was first scheduled;
* victims               -- the preempted ids in order;
* steps                 -- per step, the tokens scheduled per request and the victims;
* outputs               -- each request's finish reason and number of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cbcore_vllm.check.differences import Difference, Explanation, explain
from cbcore_vllm.check.trace import Trace


@dataclass
class Aspect:
    name: str
    agree: list[str]  # what both engines did alike, up to the divergence
    total: tuple[int, int]  # (cbcore's count, vLLM's count)
    k: int | None = None  # the step of the first divergence
    cbcore: str = ""  # what each engine did from there
    vllm: str = ""
    explanation: Explanation | None = None
    follows_step: int | None = None  # a divergence that follows from the first differing step

    @property
    def unexplained(self) -> bool:
        return self.k is not None and self.explanation is None


@dataclass
class Report:
    cbcore: Trace
    vllm: Trace
    aspects: list[Aspect] = field(default_factory=list)

    @property
    def unexplained(self) -> list[Aspect]:
        return [a for a in self.aspects if a.unexplained]


def _sequence(name: str, cb: list[tuple[int, str]], vl: list[tuple[int, str]]) -> Aspect:
    n = next((i for i, (a, b) in enumerate(zip(cb, vl, strict=False)) if a[1] != b[1]), min(len(cb), len(vl)))
    aspect = Aspect(name, [rid for _, rid in cb[:n]], (len(cb), len(vl)))
    if n < max(len(cb), len(vl)):
        aspect.k = min(seq[n][0] for seq in (cb, vl) if n < len(seq))
        aspect.cbcore = " ".join(rid for _, rid in cb[n:]) or "(none)"
        aspect.vllm = " ".join(rid for _, rid in vl[n:]) or "(none)"
    return aspect


def _step_text(scheduled: dict[str, int], preempted: list[str]) -> str:
    text = " ".join(f"{rid}:{n}" for rid, n in sorted(scheduled.items())) or "nothing"
    return text + (f", preempted {' '.join(preempted)}" if preempted else "")


def _steps(cb: Trace, vl: Trace) -> Aspect:
    by_k = [{s.k: (s.scheduled, s.preempted) for s in t.steps} for t in (cb, vl)]
    ks = sorted(set(by_k[0]) | set(by_k[1]))
    empty: tuple[dict[str, int], list[str]] = ({}, [])
    same = [k for k in ks if by_k[0].get(k, empty) == by_k[1].get(k, empty)]
    aspect = Aspect("steps", [f"{len(same)} of {len(ks)} steps identical"], (len(cb.steps), len(vl.steps)))
    differ = [k for k in ks if k not in same]
    if differ:
        k = aspect.k = differ[0]
        aspect.cbcore = _step_text(*by_k[0].get(k, empty))
        aspect.vllm = _step_text(*by_k[1].get(k, empty))
    return aspect


def _outputs(cb: Trace, vl: Trace) -> Aspect:
    ids = sorted(set(cb.output_lengths) | set(vl.output_lengths) | set(cb.finish) | set(vl.finish))

    def of(t: Trace, rid: str) -> str:
        return f"{t.finish.get(rid)}/{t.output_lengths.get(rid)}"

    differ = [rid for rid in ids if of(cb, rid) != of(vl, rid)]
    aspect = Aspect("outputs", [f"{len(ids) - len(differ)} of {len(ids)} requests end alike"], (len(cb.finish), len(vl.finish)))
    if differ:
        aspect.k = cb.steps[-1].k if cb.steps else 0
        aspect.cbcore = " ".join(f"{rid}={of(cb, rid)}" for rid in differ)
        aspect.vllm = " ".join(f"{rid}={of(vl, rid)}" for rid in differ)
    return aspect


def compare(cb: Trace, vl: Trace, differences: list[Difference]) -> Report:
    """Compare the two engines' decisions; ``differences``: those documented for this vLLM and scheduling."""
    report = Report(cb, vl)
    report.aspects = [
        _sequence("first-scheduled order", cb.first_scheduled(), vl.first_scheduled()),
        _sequence("victims", cb.victims(), vl.victims()),
        _steps(cb, vl),
        _outputs(cb, vl),
    ]
    order, victims, steps, _ = report.aspects
    if steps.k is not None:
        steps.explanation = explain(differences, vl, steps.k)
    for aspect in (order, victims):  # outputs: no documented difference changes tokens
        if aspect.k is None:
            continue
        if steps.k is not None and steps.k <= aspect.k:  # the runs parted at that step: this follows from it
            aspect.follows_step, aspect.explanation = steps.k, steps.explanation
        else:
            aspect.explanation = explain(differences, vl, aspect.k)
    return report


def render(report: Report) -> str:
    lines = []
    for a in report.aspects:
        head = f"{a.name} (cbcore {a.total[0]}, vLLM {a.total[1]})"
        if a.k is None:
            lines.append(f"{head}: agree{': ' + ' '.join(a.agree) if a.agree else ''}")
            continue
        lines.append(f"{head}: differ from step {a.k}")
        if a.agree:
            lines.append(f"  agree   {' '.join(a.agree)}")
        lines.append(f"  cbcore  {a.cbcore}")
        lines.append(f"  vLLM    {a.vllm}")
        e = a.explanation
        after = f"follows from step {a.follows_step}, where the steps part; " if a.follows_step is not None else ""
        if e is None:
            lines.append(f"  UNEXPLAINED: {after}no documented difference was at work by then")
        else:
            lines.append(f"  {after}explained by {e.difference.id} ({e.difference.title}): step {e.k}, {e.evidence}")
    bad = report.unexplained
    lines.append(
        f"result: {len(bad)} unexplained divergence{'s' * (len(bad) != 1)}" if bad
        else "result: every divergence is a documented difference" if any(a.k is not None for a in report.aspects)
        else "result: the decisions agree"
    )  # fmt: skip
    return "\n".join(lines)
