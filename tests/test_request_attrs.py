"""Per-request attributes reach policies intact, read-only, and are checked strictly."""

from __future__ import annotations

import json
import math
from types import MappingProxyType

import pytest

from cbcore import Engine, EngineConfig, QueuePolicy, RequestError, SamplingParams
from cbcore.bench.workload import BenchRequest, Workload, WorkloadError, parse_trace

EAGER = {"backend": {"name": "eager"}}


class DeadlineFirst(QueuePolicy):
    """Earliest deadline first; records what it saw of each request."""

    name = "test-edf"

    def __init__(self, params=None):
        super().__init__(params)
        self.seen: dict[str, tuple] = {}

    def key(self, seq, now):
        self.seen[seq.request_id] = (seq.priority, seq.client_id, seq.deadline_s, seq.deadline, seq.attrs)
        return (seq.deadline if seq.deadline is not None else math.inf, seq.arrival_time)


def engine_for(model, **extra):
    return Engine(model, config=EngineConfig.model_validate({**EAGER, **extra}))


def nested(levels: int, key: str = "d") -> dict:
    """``{"d": {"d": ... {}}}``: ``levels`` objects, the outermost included (built without recursion)."""
    top: dict = {}
    inner = top
    for _ in range(levels - 1):
        inner[key] = {}
        inner = inner[key]
    return top


def cyclic() -> dict:
    loop: dict = {"x": [1]}
    loop["x"].append(loop)
    return loop


def test_policy_reads_every_field(models):
    engine = engine_for(
        models["llama"],
        scheduler={"queue": {"name": f"{__file__}:DeadlineFirst"}, "budget": {"name": "token-budget", "max_num_seqs": 1}},
    )
    attrs = {"tier": "gold", "tags": ["a", {"b": 1}], "weight": 2.5, "flag": None}
    engine.add_request([1, 2, 3], request_id="late", deadline_s=9.0, arrival_time=0.0)
    engine.add_request(
        [4, 5], request_id="soon", priority=2, client_id="alice", deadline_s=1.5, attrs=attrs, arrival_time=0.5
    )
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["soon", "late"]  # one slot: the earlier deadline runs first
    prio, client, deadline_s, deadline, seen = engine.scheduler.door.queue.seen["soon"]
    assert (prio, client, deadline_s, deadline) == (2, "alice", 1.5, 2.0)
    assert isinstance(seen, MappingProxyType) and seen["tags"][1]["b"] == 1
    with pytest.raises(TypeError):
        seen["tier"] = "free"  # read-only for policies
    attrs["tier"] = "changed by the caller"
    assert seen["tier"] == "gold"  # a copy: the caller cannot change it later either
    assert engine.scheduler.door.queue.seen["late"][:4] == (0, "default", 9.0, 9.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"request_id": 123}, "request_id must be a non-empty str"),
        ({"request_id": ""}, "request_id must be a non-empty str"),
        ({"priority": "5"}, "priority must be an int"),
        ({"priority": True}, "priority must be an int"),
        ({"priority": 1.0}, "priority must be an int"),
        ({"client_id": 7}, "client_id must be a non-empty str"),
        ({"deadline_s": "3"}, "deadline_s must be a number"),
        ({"deadline_s": 0}, "finite and > 0"),
        ({"deadline_s": math.inf}, "finite and > 0"),
        ({"deadline_s": math.nan}, "finite and > 0"),
        ({"attrs": ["tier"]}, "attrs must be a mapping"),
        ({"attrs": {"when": object()}}, r"attrs.when: object .* is not a JSON value"),
        ({"attrs": {"x": {1: "a"}}}, "attrs.x: key 1 is not a str"),
        ({"attrs": {"x": [math.nan]}}, r"attrs.x\[0\]: nan is not a JSON number"),
        # Deep nesting is refused by its path at 64 levels, before it can overflow the stack (900 levels did once).
        ({"attrs": nested(900)}, r"^request 'req-0': attrs(\.d){64}: nested deeper than 64 levels$"),
        ({"attrs": nested(100_000, "k" * 50)}, r": attrs(\.k{50}){3}\.k{41}\.\.\.: nested deeper than 64 levels$"),
        ({"attrs": cyclic()}, r"attrs\.x\[1\]\.x\[1\].*: nested deeper than 64 levels"),
        ({"arrival_time": "now"}, "arrival_time must be a number"),
    ],
)
def test_bad_fields_are_refused_and_register_nothing(models, kwargs, message):
    engine = engine_for(models["llama"])
    with pytest.raises(RequestError, match=message):
        engine.add_request([1, 2], **kwargs)
    assert not engine.has_unfinished()


def test_attrs_at_the_depth_limit_are_copied_whole_and_in_order():
    from cbcore.bench.workload import thaw
    from cbcore.scheduling.request import freeze_attrs

    deep = nested(64)
    deep["d"]["list"] = [[1, {"b": 2.5, "a": None}], [], "s", True]
    frozen = freeze_attrs(deep)
    assert thaw(frozen) == deep and json.dumps(thaw(frozen)) == json.dumps(deep)  # key order kept
    assert isinstance(frozen["d"]["list"][0][1], MappingProxyType) and isinstance(frozen["d"]["list"], tuple)
    with pytest.raises(ValueError, match=r"^attrs(\.d){64}: nested deeper than 64 levels$"):
        freeze_attrs(nested(65))


def test_generate_takes_per_prompt_lists(models):
    engine = engine_for(models["llama"])
    outs = engine.generate(
        [[1, 2], [3, 4], [5]],
        SamplingParams(max_new_tokens=2),
        priorities=[0, 1, 2],
        client_ids="c",
        deadlines_s=[None, 4.0, 2.0],
        attrs=[{"k": 1}, None, {"bad": {3}}],
    )
    assert [o.finish_reason for o in outs[:2]] == ["length", "length"]
    assert outs[2].finish_reason == "error" and "attrs.bad" in outs[2].error
    with pytest.raises(ValueError, match="deadlines_s: got 2 values for 3 prompts"):
        engine.generate([[1], [2], [3]], deadlines_s=[1.0, 2.0])
    assert not engine.has_unfinished()


def test_trace_carries_deadline_and_attrs(tmp_path):
    req = BenchRequest(request_id="r", arrival_s=0.5, max_new_tokens=4, prompt_token_ids=(1, 2), priority=1, client_id="a", deadline_s=3.0,
                       attrs={"tier": "gold", "n": [1, 2]})
    path = tmp_path / "trace.jsonl"
    Workload("w", (req,)).save(path)
    line = json.loads(path.read_text())
    assert line["deadline_s"] == 3.0 and line["attrs"] == {"tier": "gold", "n": [1, 2]}
    again = Workload.load(path).requests[0]
    assert (again.priority, again.client_id, again.deadline_s, again.attrs["n"]) == (1, "a", 3.0, (1, 2))


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ('"priority": "1"', "priority"),
        ('"deadline_s": -1', "deadline_s"),
        ('"attrs": [1]', "attrs"),
        ('"client_id": ""', "client_id"),
        ('"request_id": 5', "request_id"),
    ],
)
def test_trace_fields_are_strict(field, message):
    line = '{"arrival_s": 0, "prompt_token_ids": [1], "max_new_tokens": 2, ' + field + '}'
    with pytest.raises(WorkloadError, match=f"trace:1: .*{message}"):
        parse_trace([line])
