"""cbcore-sjf: predictors, aging, and output equivalence."""

from __future__ import annotations

from pathlib import Path

import pytest
from cbcore_sjf import PREDICTORS, ShortestPredictedJobFirst, SJFParams, register_predictor
from pydantic import ValidationError

from cbcore.plugins import PluginError
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.scheduling.sequence import Sequence
from cbcore.testing import random_prompts


def seq(rid: str, prompt_len: int, cap: int = 100, arrival: float = 0.0) -> Sequence:
    return Sequence(rid, [3] * prompt_len, SamplingParams(max_new_tokens=cap), arrival_time=arrival)


def test_default_predictor_is_the_prompt_length_within_the_cap() -> None:
    sjf = ShortestPredictedJobFirst(SJFParams(aging_s=None))
    short, long, capped = seq("short", 5), seq("long", 50), seq("capped", 80, cap=3)
    for s in (short, long, capped):
        sjf.on_arrival(s, 0.0)
    assert sjf.predicted == {"short": 5.0, "long": 50.0, "capped": 3.0}
    assert [s.request_id for s in sjf.order([long, short, capped], now=0.0)] == ["capped", "short", "long"]


def test_remaining_size_shrinks_with_generated_tokens_and_waiting() -> None:
    sjf = ShortestPredictedJobFirst(SJFParams(aging_s=10.0))
    s = seq("s", 40)
    sjf.on_arrival(s, 0.0)
    assert sjf.size(s, now=0.0) == pytest.approx(40.0)
    s.token_ids.extend([7] * 10)  # 10 generated
    assert sjf.size(s, now=10.0) == pytest.approx(30.0 / 2)
    s.token_ids.extend([7] * 50)  # beyond the prediction: nothing predicted remains
    assert sjf.size(s, now=10.0) == 0.0


def test_predictor_by_module_path(tmp_path: Path) -> None:
    path = tmp_path / "my_predictors.py"
    path.write_text("def tenth(seq):\n    return seq.num_prompt_tokens / 10\n")
    sjf = ShortestPredictedJobFirst(SJFParams(predictor=f"{path}:tenth"))
    s = seq("s", 40)
    sjf.on_arrival(s, 0.0)
    assert sjf.predicted["s"] == 4.0


def test_registered_predictor_by_name() -> None:
    register_predictor("always-one", lambda seq: 1.0)
    try:
        assert ShortestPredictedJobFirst(SJFParams(predictor="always-one")).predict(seq("s", 9)) == 1.0
        with pytest.raises(PluginError, match="already registered"):
            register_predictor("always-one", lambda seq: 2.0)
    finally:
        PREDICTORS.pop("always-one")


def test_unknown_predictor_lists_the_known_ones() -> None:
    with pytest.raises(
        ValidationError, match=r"unknown predictor 'oracle'; known: max-new-tokens, prompt-length"
    ):
        SJFParams(predictor="oracle")
    with pytest.raises(ValidationError, match=r"no attribute 'nope'"):
        SJFParams(predictor="cbcore_sjf.predictors:nope")


def test_sjf_keeps_outputs_identical(cb_equivalence) -> None:
    report = cb_equivalence(
        {
            "scheduler": {
                "queue": {"name": "sjf", "aging_s": 1.0},
                "budget": {"name": "token-budget", "max_num_seqs": 4, "max_num_batched_tokens": 16},
            },
            "kv_cache": {"block_size": 4, "num_blocks": 14},
        },
        prompts=random_prompts(6, 4, 24, seed=2),
        max_new_tokens=20,
    )
    assert report.engine.scheduler.num_preemptions > 0
    assert report.engine.scheduler.num_partial_prefills > 0


def test_noise_multiplies_each_prediction_by_a_per_request_lognormal_factor() -> None:
    import math
    import statistics

    exact = ShortestPredictedJobFirst(SJFParams(predictor="max-new-tokens", aging_s=None))
    noisy = ShortestPredictedJobFirst(SJFParams(predictor="max-new-tokens", aging_s=None, noise_sigma=0.5))
    again = ShortestPredictedJobFirst(SJFParams(predictor="max-new-tokens", aging_s=None, noise_sigma=0.5))
    other = ShortestPredictedJobFirst(SJFParams(predictor="max-new-tokens", aging_s=None, noise_sigma=0.5, noise_seed=1))
    seqs = [seq(f"r{i}", 5, cap=100) for i in range(2000)]
    for policy in (exact, noisy, again, other):
        for s in reversed(seqs) if policy is again else seqs:  # arrival order does not change a factor
            policy.on_arrival(s, 0.0)
    assert set(exact.predicted.values()) == {100.0}
    assert noisy.predicted == again.predicted != other.predicted
    logs = [math.log(p / 100.0) for p in noisy.predicted.values()]
    assert abs(statistics.fmean(logs)) < 0.05 and statistics.stdev(logs) == pytest.approx(0.5, rel=0.08)
    with pytest.raises(ValidationError):
        SJFParams(noise_sigma=-1)
