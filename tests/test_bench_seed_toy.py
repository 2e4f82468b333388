"""The seed-toy baseline serves the workload correctly: per-prompt tokens, slot limit, timelines."""

from __future__ import annotations

from cbcore.bench.generator import generate
from cbcore.bench.seed_toy import run_seed_toy
from cbcore.bench.suite import reference_outputs
from cbcore.testing import assert_equivalent, compare_greedy, tiny_model


def test_seed_toy_matches_per_prompt_generate_within_its_slots():
    model = tiny_model("llama")
    workload = generate("poisson:n=5,rate=inf,lengths=uniform,input_len=12,output_len=10,seed=3", 512)
    ids = [r.token_ids(None) for r in workload.requests]
    before = model.config._attn_implementation
    run = run_seed_toy(model, workload, ids, batch_size=2)
    assert model.config._attn_implementation == before, "the toy's eager attention is switched back"
    assert run.name == "seed-toy" and run.info == {"batch_size": 2}
    assert_equivalent(compare_greedy(model, run.outputs, reference_outputs(model, workload, ids)))
    for req, out in zip(workload.requests, run.outputs, strict=True):
        m = out.metrics
        assert len(out.output_token_ids) == req.max_new_tokens == len(m.token_times)
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
    # Two slots: the third request starts only once one of the first two has finished.
    first_two_done = min(o.metrics.finish_time for o in run.outputs[:2])
    assert run.outputs[2].metrics.first_scheduled_time >= first_two_done
