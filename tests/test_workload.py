"""Workloads: the seed set, the generator's distributions and seeding, trace replay and validation."""

from __future__ import annotations

import itertools
import json
import math
from statistics import fmean, median, pstdev

import pytest

from cbcore.bench.generator import arrival_times, generate, parse_spec
from cbcore.bench.sources import load_workload, seed_workload
from cbcore.bench.workload import RequestRecord, Workload, WorkloadError
from cbcore.demo.run import DEMO_REQUESTS

VOCAB = 512
SPECIAL = [0, 1, 2]


def gaps(w: Workload) -> list[float]:
    times = sorted(r.arrival_s for r in w.requests)
    return [b - a for a, b in itertools.pairwise(times)]


def test_seed_workload_is_the_seeds_six_requests_at_t0() -> None:
    w = load_workload("seed")
    assert [r.max_new_tokens for r in w.requests] == [6, 50, 300, 30, 180, 45]
    assert [r.prompt for r in w.requests] == [p for p, _ in DEMO_REQUESTS]  # what `cb demo` runs
    assert all(r.arrival_s == 0 for r in w.requests)
    assert w.requests[0].prompt == "The capital of France is"


def test_same_spec_same_requests_and_seed_changes_them() -> None:
    spec = "poisson:n=20,rate=3,lengths=sharegpt,seed=7,clients=a:1/b:1"
    a, b = generate(spec, VOCAB, SPECIAL), generate(spec, VOCAB, SPECIAL)
    assert a.requests == b.requests
    c = generate(spec.replace("seed=7", "seed=8"), VOCAB, SPECIAL)
    assert [r.prompt_token_ids for r in c.requests] != [r.prompt_token_ids for r in a.requests]
    assert [r.arrival_s for r in c.requests] != [r.arrival_s for r in a.requests]


def test_changing_the_rate_keeps_the_prompts() -> None:
    a = generate("poisson:n=10,rate=1,seed=3", VOCAB, SPECIAL)
    b = generate("poisson:n=10,rate=5,seed=3", VOCAB, SPECIAL)
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    assert [r.arrival_s for r in a.requests] != [r.arrival_s for r in b.requests]


def test_infinite_rate_sends_everything_at_t0() -> None:
    w = generate("poisson:n=12,lengths=fixed", VOCAB, SPECIAL)
    assert all(r.arrival_s == 0 for r in w.requests)


def test_poisson_gaps_have_mean_one_over_rate_and_cv_one() -> None:
    w = generate("poisson:n=4000,rate=4,lengths=fixed,input_len=1,output_len=1,seed=1", VOCAB, SPECIAL)
    g = gaps(w)
    assert w.requests[0].arrival_s == 0
    assert fmean(g) == pytest.approx(0.25, rel=0.05)
    assert pstdev(g) / fmean(g) == pytest.approx(1.0, abs=0.06)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_is_the_gamma_shape(burstiness: float) -> None:
    import random

    g = arrival_times(4000, 2.0, burstiness, random.Random(0))
    d = [b - a for a, b in itertools.pairwise(g)]
    assert fmean(d) == pytest.approx(0.5, rel=0.08)
    # The coefficient of variation of a gamma(k) variable is 1/sqrt(k).
    assert pstdev(d) / fmean(d) == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_fixed_and_uniform_lengths() -> None:
    w = generate("poisson:n=50,lengths=fixed,input_len=12,output_len=7", VOCAB, SPECIAL)
    assert {len(r.prompt_token_ids) for r in w.requests} == {12}
    assert {r.max_new_tokens for r in w.requests} == {7}
    u = generate("poisson:n=2000,lengths=uniform,input_len=100,output_len=40,range_ratio=0.5", VOCAB, SPECIAL)
    ins = [len(r.prompt_token_ids) for r in u.requests]
    outs = [r.max_new_tokens for r in u.requests]
    assert min(ins) >= 50 and max(ins) <= 150 and min(outs) >= 20 and max(outs) <= 60
    assert fmean(ins) == pytest.approx(100, rel=0.05)
    assert len(set(ins)) > 50  # really spread out


def test_sharegpt_lengths_are_long_tailed_with_the_requested_mean() -> None:
    w = generate("poisson:n=3000,lengths=sharegpt,input_len=60,output_len=50,max_input=2000", VOCAB, SPECIAL)
    outs = [r.max_new_tokens for r in w.requests]
    ins = [len(r.prompt_token_ids) for r in w.requests]
    assert fmean(outs) == pytest.approx(50, rel=0.1)
    assert fmean(ins) == pytest.approx(60, rel=0.1)
    assert median(outs) < 0.8 * fmean(outs)  # right-skewed
    assert max(outs) > 6 * median(outs)  # a long tail
    capped = generate("poisson:n=500,lengths=sharegpt,max_output=64", VOCAB, SPECIAL)
    assert max(r.max_new_tokens for r in capped.requests) == 64


def test_sharegpt_defaults_match_its_means() -> None:
    _, spec = parse_spec("poisson:lengths=sharegpt")
    assert spec.means == (220, 200)
    assert spec.n == 64 and spec.ignore_eos


def test_clients_and_priorities_follow_their_weights() -> None:
    w = generate("poisson:n=4000,lengths=fixed,input_len=1,clients=a:3/b:1,priorities=0/1/2", VOCAB, SPECIAL)
    share_a = sum(r.client_id == "a" for r in w.requests) / len(w)
    assert share_a == pytest.approx(0.75, abs=0.03)
    assert w.clients == ["a", "b"]
    for p in (0, 1, 2):
        assert sum(r.priority == p for r in w.requests) / len(w) == pytest.approx(1 / 3, abs=0.03)


def test_prompt_tokens_avoid_special_ids_and_stay_in_vocab() -> None:
    w = generate("poisson:n=50,lengths=fixed,input_len=64", 8, [0, 1, 2])
    ids = {t for r in w.requests for t in r.prompt_token_ids}
    assert ids == {3, 4, 5, 6, 7}
    with pytest.raises(WorkloadError, match="no ordinary tokens"):
        generate("poisson:n=1", 3, [0, 1, 2])


def test_trace_round_trip_replays_exactly(tmp_path) -> None:
    w = generate("poisson:n=30,rate=2,burstiness=0.5,clients=x:1/y:2,priorities=0:1/3:1", VOCAB, SPECIAL)
    path = tmp_path / "trace.jsonl"
    w.save(path)
    again = load_workload(str(path))
    assert again.requests == w.requests
    assert again.name == str(path)
    s = seed_workload()
    s.save(path)
    assert Workload.load(path).requests == s.requests


def _trace(tmp_path, *lines: object) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(path)


GOOD = {"arrival_s": 0.0, "prompt_token_ids": [5, 6], "max_new_tokens": 3}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"prompt_token_ids": [5], "max_new_tokens": 3}, r"bad.jsonl:2: arrival_s: Field required"),
        ({"arrival_s": 1.0, "prompt_token_ids": [5]}, r":2: max_new_tokens: Field required"),
        ({**GOOD, "arrival_s": -0.5}, r":2: arrival_s: Input should be greater than or equal to 0"),
        ({**GOOD, "max_new_tokens": 0}, r":2: max_new_tokens"),
        ({"arrival_s": 0, "max_new_tokens": 2}, r":2: .*exactly one of 'prompt'"),
        ({**GOOD, "prompt": "hi"}, r":2: .*exactly one of 'prompt'"),
        ({**GOOD, "prompt_token_ids": [3, -1]}, r":2: .*negative id"),
        ({**GOOD, "colour": "red"}, r":2: colour: Extra inputs are not permitted"),
        ("{not json", r":2: not valid JSON"),
        ("[1, 2]", r":2: expected a JSON object"),
    ],
)
def test_bad_trace_is_rejected_with_the_line_number(tmp_path, bad: object, message: str) -> None:
    path = _trace(tmp_path, GOOD, bad, GOOD)
    with pytest.raises(WorkloadError, match=message):
        load_workload(path)


def test_trace_blank_lines_are_skipped_but_line_numbers_kept(tmp_path) -> None:
    path = _trace(tmp_path, GOOD, "", {**GOOD, "arrival_s": -1})
    with pytest.raises(WorkloadError, match=r":3: arrival_s"):
        load_workload(path)


def test_empty_trace_and_duplicate_ids_are_rejected(tmp_path) -> None:
    with pytest.raises(WorkloadError, match="no requests"):
        load_workload(_trace(tmp_path, ""))
    dup = {**GOOD, "request_id": "a"}
    with pytest.raises(WorkloadError, match="'a' appears twice"):
        load_workload(_trace(tmp_path, dup, dup))
    with pytest.raises(WorkloadError, match="cannot read trace"):
        load_workload(str(tmp_path / "missing.jsonl"))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("poisson:n=0", r"n: Input should be greater than or equal to 1"),
        ("poisson:rate=-1", r"rate: Input should be greater than 0"),
        ("poisson:lengths=zipf", r"lengths: Input should be 'fixed', 'uniform', 'sharegpt' or 'arxiv-summarization'"),
        ("poisson:colour=red", r"colour: Extra inputs are not permitted"),
        ("poisson:n", r"expected key=value"),
        ("poisson:n=2,rate=1,n=3", r"n is given twice"),
        ("poisson:clients=a:0", r"clients: .*weights must be positive"),
        ("poisson:clients=a:x", r"clients\.a"),
        ("zipf:n=3", r"expected 'seed', a .jsonl trace, or a generator"),
    ],
)
def test_bad_generator_spec_names_the_key(spec: str, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        load_workload(spec, VOCAB, SPECIAL)


def test_generator_needs_the_vocabulary() -> None:
    with pytest.raises(WorkloadError, match="vocabulary size"):
        load_workload("poisson:n=2")


def test_every_record_field_survives_a_trace_round_trip() -> None:
    """A field the JSON writer forgets would silently vanish from saved traces."""
    full = {
        "request_id": "a", "arrival_s": 0.5, "prompt_token_ids": [3, 4], "max_new_tokens": 2, "temperature": 0.5,
        "top_k": 3, "top_p": 0.9, "seed": 7, "ignore_eos": True, "priority": 2, "client_id": "c", "deadline_s": 1.5,
        "follows": "z", "attrs": {"tier": ["gold"]},
    }  # fmt: skip
    prompts = {
        "prompt": "hi",
        "messages": [{"role": "user", "content": "hi", "name": "x"}],
        "synthetic_prompt": {"tokens": 700, "seed": 3, "hash_ids": [5, 9], "block_tokens": 512.0,
                             "vocab_size": 100, "special_ids": [0, 1]},
    }  # fmt: skip
    assert {*full, *prompts} == set(RequestRecord.model_fields), "a new record field needs a place in this test"
    for data in (full, *({**full, "prompt_token_ids": None, key: value} for key, value in prompts.items())):
        data = {k: v for k, v in data.items() if v is not None}
        record = RequestRecord.model_validate(data)
        assert record.to_json() == data
        assert RequestRecord.model_validate(record.to_json()) == record


def test_the_old_id_spelling_is_read_as_request_id_and_both_at_once_are_refused(tmp_path) -> None:
    path = _trace(tmp_path, {**GOOD, "id": "old"})
    assert [r.request_id for r in Workload.load(path).requests] == ["old"]
    with pytest.raises(WorkloadError, match=r":2: give 'request_id' only \('id' is its old spelling\)"):
        Workload.load(_trace(tmp_path, GOOD, {**GOOD, "id": "x", "request_id": "y"}))


def test_a_workload_decodes_greedily_and_says_where_sampling_belongs(tmp_path) -> None:
    with pytest.raises(WorkloadError, match=r":1: temperature: a workload decodes greedily"):
        Workload.load(_trace(tmp_path, {**GOOD, "temperature": 0.7}))


def test_one_record_gives_the_sampling_params_and_the_prompt() -> None:
    record = RequestRecord.model_validate({"prompt_token_ids": [5], "temperature": 0.5, "ignore_eos": True})
    params = record.sampling_params({"max_new_tokens": 9, "temperature": 0.0})
    assert (params.max_new_tokens, params.temperature, params.ignore_eos) == (9, 0.5, True)
    assert record.token_ids(None) == [5] and not record.is_text
    text = RequestRecord(prompt="hi")
    assert text.is_text
    with pytest.raises(WorkloadError, match="a text prompt needs a tokenizer"):
        text.token_ids(None)
