"""Production traces as workloads: formats, windows, rates, the length rule, synthetic prompts, prefix sharing.

The excerpts in tests/data are unchanged lines of the Azure, Mooncake and Vidur traces
(tests/data/README-traces.md), so every expectation here is read from the same
lines by the test itself.
"""

from __future__ import annotations

import csv
import json
from datetime import datetime
from pathlib import Path

import pytest

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.bench.driver import VirtualClock, drive
from cbcore.bench.sources import load_workload, needs_vocabulary
from cbcore.bench.suite import prompt_token_ids
from cbcore.bench.sweep import Sweep
from cbcore.bench.synthetic import PromptIds, SyntheticPrompt
from cbcore.bench.traces import describe_rule, shipped_path
from cbcore.bench.workload import BenchRequest, Workload, WorkloadError
from cbcore.cli.main import main
from cbcore.testing.tiny_models import EOS, VOCAB

DATA = Path(__file__).parent / "data"
AZURE = DATA / "azure-conv-2023-excerpt.csv"
MOONCAKE = DATA / "mooncake-conversation-excerpt.jsonl"
VIDUR_CONV = DATA / "vidur-splitwise-conv-excerpt.csv"
VIDUR_ARXIV = DATA / "vidur-arxiv-summarization-excerpt.csv"
SPECIAL = (0, 1, EOS)


def azure_rows() -> list[tuple[float, int, int]]:
    """(seconds after the first row, prompt, output) of the Azure excerpt, read here independently."""
    with AZURE.open() as f:
        rows = [(datetime.fromisoformat(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
                for r in csv.DictReader(f)]  # fmt: skip
    first = rows[0][0]
    return [((t - first).total_seconds(), n_in, n_out) for t, n_in, n_out in rows]


def mooncake_rows() -> list[dict]:
    return [json.loads(line) for line in MOONCAKE.read_text().splitlines()]


def azure(options: str = "", context: int | None = None) -> Workload:
    return load_workload(f"trace:path={AZURE}{',' + options if options else ''}", 32000, SPECIAL, context)


def mooncake(options: str = "", context: int | None = None, vocab: int = 32000) -> Workload:
    return load_workload(f"trace:path={MOONCAKE}{',' + options if options else ''}", vocab, SPECIAL, context)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# -- each format, as in the file ------------------------------------------------------------------


def test_azure_arrivals_and_lengths_are_the_files() -> None:
    w = azure()
    rows = azure_rows()
    assert [r.request_id for r in w.requests] == [f"r{i}" for i in range(len(rows))]
    assert [r.arrival_s for r in w.requests] == pytest.approx([t for t, _, _ in rows], abs=1e-6)
    assert [r.synthetic_prompt.tokens for r in w.requests] == [n for _, n, _ in rows]
    assert [len(r.token_ids(None)) for r in w.requests] == [n for _, n, _ in rows]
    assert [r.max_new_tokens for r in w.requests] == [n for _, _, n in rows]
    assert all(r.ignore_eos for r in w.requests)  # each request produces the trace's output length
    assert w.describe()["trace"]["format"] == "azure"


def test_mooncake_arrivals_lengths_and_prefix_sharing_are_the_files() -> None:
    w = mooncake()
    rows = mooncake_rows()
    assert [r.arrival_s for r in w.requests] == pytest.approx([x["timestamp"] / 1000 for x in rows])
    assert [r.synthetic_prompt.tokens for r in w.requests] == [x["input_length"] for x in rows]
    assert [r.max_new_tokens for r in w.requests] == [x["output_length"] for x in rows]
    ids = [r.token_ids(None) for r in w.requests]
    shared_beyond_first = 0
    for i in range(len(rows)):
        for j in range(i):
            blocks = common_prefix(rows[i]["hash_ids"], rows[j]["hash_ids"])
            shortest = min(len(ids[i]), len(ids[j]))
            # Equal hash ids are equal 512-token blocks; the first differing block differs at once.
            assert common_prefix(ids[i], ids[j]) == min(blocks * 512, shortest), (i, j)
            shared_beyond_first += blocks > 1
    assert shared_beyond_first >= 5  # the excerpt holds real multi-block sharing, not only the common block 0


def test_cbcore_jsonl_is_read_by_its_columns_and_windowed(tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    azure().save(path)
    assert needs_vocabulary(str(path)) is False  # cbcore's own trace replays exactly, as before
    exact = load_workload(str(path))
    assert exact.requests == azure().requests
    window = load_workload(f"trace:path={path},start_s=5,limit=3")
    assert [r.request_id for r in window.requests] == [r.request_id for r in azure("start_s=5,limit=3").requests]
    assert window.describe()["trace"]["format"] == "cbcore"


def test_vidur_csv_arrivals_and_lengths_are_the_files() -> None:
    with VIDUR_CONV.open() as f:
        rows = [(float(r["arrived_at"]), int(r["num_prefill_tokens"]), int(r["num_decode_tokens"]))
                for r in csv.DictReader(f)]  # fmt: skip
    w = load_workload(f"trace:path={VIDUR_CONV}", 32000, SPECIAL)
    assert w.describe()["trace"]["format"] == "vidur"
    assert [r.arrival_s for r in w.requests] == pytest.approx([t - rows[0][0] for t, _, _ in rows])
    assert [r.synthetic_prompt.tokens for r in w.requests] == [n for _, n, _ in rows]
    assert [r.max_new_tokens for r in w.requests] == [n for _, _, n in rows]


def test_a_vidur_csv_without_arrivals_needs_a_rate() -> None:
    with VIDUR_ARXIV.open() as f:
        rows = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(f)]
    with pytest.raises(WorkloadError, match=r"holds no arrival times .*give rate=R"):
        load_workload(f"trace:path={VIDUR_ARXIV}", 32000, SPECIAL)
    w = load_workload(f"trace:path={VIDUR_ARXIV},rate=4,seed=3", 32000, SPECIAL)
    assert [r.synthetic_prompt.tokens for r in w.requests] == [n for n, _ in rows]
    assert [r.max_new_tokens for r in w.requests] == [n for _, n in rows]
    assert len(w) / w.span_s == pytest.approx(4, rel=0.3)  # Poisson arrivals at the asked mean rate (20 of them)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(w.requests, w.requests[1:], strict=False)]
    assert len(set(gaps)) == len(gaps)  # drawn, not evenly spaced
    again = load_workload(f"trace:path={VIDUR_ARXIV},rate=4,seed=3", 32000, SPECIAL)
    assert [r.arrival_s for r in again.requests] == [r.arrival_s for r in w.requests]


def test_unknown_columns_are_named_in_the_error(tmp_path) -> None:
    path = tmp_path / "odd.csv"
    path.write_text("when,prompt_len,answer_len\n1,2,3\n")
    with pytest.raises(WorkloadError, match=r"columns when, prompt_len, answer_len match no known trace format"):
        load_workload(f"trace:path={path}", 100)


def test_gzip_is_recognised_by_its_bytes_not_its_name(tmp_path) -> None:
    import gzip

    path = tmp_path / "trace.data"
    path.write_bytes(gzip.compress(MOONCAKE.read_bytes()))
    assert load_workload(f"trace:path={path}", 32000, SPECIAL).requests == mooncake().requests


# -- windows, rates, lengths ----------------------------------------------------------------------


def test_a_window_takes_the_rows_in_it_and_keeps_their_ids_and_offsets() -> None:
    rows = azure_rows()
    w = azure("start_s=2,duration_s=4")
    inside = [i for i, (t, _, _) in enumerate(rows) if 2 <= t < 6]
    assert [r.request_id for r in w.requests] == [f"r{i}" for i in inside]
    assert [r.arrival_s for r in w.requests] == pytest.approx([rows[i][0] - 2 for i in inside])
    assert len(azure("start_s=2,duration_s=4,limit=2")) == 2
    with pytest.raises(WorkloadError, match="no request of the trace falls in the window"):
        azure("start_s=1000")


def test_rate_rescales_arrivals_to_the_asked_mean_and_time_scale_multiplies_them() -> None:
    base = azure()
    fast = azure("rate=40")
    assert len(fast) / fast.span_s == pytest.approx(40)
    ratio = fast.requests[5].arrival_s / base.requests[5].arrival_s
    assert [r.arrival_s for r in fast.requests] == pytest.approx([r.arrival_s * ratio for r in base.requests])
    slow = azure("time_scale=2")
    assert [r.arrival_s for r in slow.requests] == pytest.approx([2 * r.arrival_s for r in base.requests])
    with pytest.raises(WorkloadError, match="give rate= or time_scale=, not both"):
        azure("rate=4,time_scale=2")


def test_overlong_requests_are_counted_dropped_or_clipped_never_silently() -> None:
    rows = azure_rows()
    over = [i for i, (_, n_in, n_out) in enumerate(rows) if n_in + n_out > 4096]
    assert len(over) == 3
    dropped = azure(context=4096)
    assert len(dropped) == len(rows) - 3
    assert {f"r{i}" for i in over}.isdisjoint(r.request_id for r in dropped.requests)
    rule = dropped.describe()["trace"]["length_rule"]
    assert (rule["over_context"], rule["dropped"], rule["clipped"]) == (3, 3, 0)
    assert "3 of 26 requests over the limits (context 4096) dropped" in describe_rule(dropped.trace)

    clipped = azure("overlong=clip", context=4096)
    assert len(clipped) == len(rows)
    by_id = {r.request_id: r for r in clipped.requests}
    for i in over:  # the prompt gives way, the output is kept (Vidur's trace-replay rule)
        r = by_id[f"r{i}"]
        assert r.synthetic_prompt.tokens + r.max_new_tokens == 4096
        assert r.max_new_tokens == rows[i][2]
    assert clipped.describe()["trace"]["length_rule"]["clipped"] == 3

    limited = azure("max_input=500,max_output=100,overlong=clip")
    assert max(r.synthetic_prompt.tokens for r in limited.requests) == 500
    assert max(r.max_new_tokens for r in limited.requests) == 100
    expect = sum(n_in > 500 or n_out > 100 for _, n_in, n_out in rows)
    assert limited.describe()["trace"]["length_rule"]["clipped"] == expect
    with pytest.raises(WorkloadError, match="every one of the window's 26 requests is over the length limits"):
        azure("max_input=1")


def test_the_report_says_what_the_length_rule_did(tmp_path, capsys) -> None:
    out = tmp_path / "sim.json"
    code = main([
        "simulate", "--profile", "a100-llama-2-7b-tp1", "--workload", f"trace:path={AZURE}", "--policy", "fcfs",
        "--no-progress", "--json", str(out),
    ])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "3 of 26 requests over the limits (context 4096) dropped" in printed
    data = json.loads(out.read_text())
    assert data["workload"]["trace"]["length_rule"]["dropped"] == 3
    assert data["rows"][0]["completed"] == 23


def test_length_scale_scales_blocks_too_so_the_shared_share_stays() -> None:
    rows = mooncake_rows()
    w = mooncake("length_scale=0.25")
    assert [r.synthetic_prompt.tokens for r in w.requests] == [round(x["input_length"] / 4) for x in rows]
    assert [r.max_new_tokens for r in w.requests] == [max(1, round(x["output_length"] / 4)) for x in rows]
    a, b = w.requests[1].token_ids(None), w.requests[10].token_ids(None)  # lines 2 and 138: 14 shared blocks
    assert common_prefix(a, b) == 14 * 128


# -- prompts --------------------------------------------------------------------------------------


def test_prompts_are_seeded_within_the_vocabulary_and_never_special() -> None:
    first, again, other = mooncake(vocab=VOCAB), mooncake(vocab=VOCAB), mooncake("seed=1", vocab=VOCAB)
    ids = [r.token_ids(None) for r in first.requests]
    assert ids == [r.token_ids(None) for r in again.requests]
    assert ids != [r.token_ids(None) for r in other.requests]
    flat = {t for p in ids for t in p}
    assert flat.isdisjoint(SPECIAL) and max(flat) < VOCAB
    assert len(flat) == VOCAB - len(SPECIAL)  # ~150k draws cover every ordinary id


def test_a_synthetic_prompt_is_one_record_field_and_replays_from_json(tmp_path) -> None:
    w = mooncake("limit=3")
    path = tmp_path / "saved.jsonl"
    w.save(path)
    assert len(path.read_text()) < 4000  # the recipe is saved, not 20,000 token ids
    again = Workload.load(path)
    assert [r.token_ids(None) for r in again.requests] == [r.token_ids(None) for r in w.requests]
    with pytest.raises(ValueError, match="3 hash_ids for 2000 tokens in blocks of 512: expected 4"):
        SyntheticPrompt(tokens=2000, hash_ids=(1, 2, 3), vocab_size=10)


def test_the_simulator_keeps_prompts_as_recipes_in_its_outputs() -> None:
    from cbcore.sim.executor import sim_engine
    from cbcore.sim.profile import load_profile

    w = azure(context=4096)
    prompts = prompt_token_ids(w, None, lazy=True)
    assert all(isinstance(p, PromptIds) for p in prompts)
    profile = load_profile("a100-llama-2-7b-tp1")
    run = drive([sim_engine(EngineConfig(), profile, VirtualClock())], "x", w, prompts)
    assert all(isinstance(o.prompt_token_ids, PromptIds) for o in run.outputs)
    assert [len(o.prompt_token_ids) for o in run.outputs] == [r.synthetic_prompt.tokens for r in w.requests]


# -- the real engine sees the trace's sharing ------------------------------------------------------


@pytest.mark.parametrize("caching", [True, False])
def test_mooncake_hashes_give_prefix_cache_hits_in_the_real_engine(models, caching) -> None:
    """Requests served one after another: each finds exactly the blocks its hash ids share with earlier ones."""
    block = 16  # length_scale 1/32 makes Mooncake's 512-token blocks 16 tokens: one KV block each
    w = load_workload(f"trace:path={MOONCAKE},length_scale=0.03125,max_output=4,overlong=clip", VOCAB, SPECIAL, 512)
    rows = {f"r{i}": x for i, x in enumerate(mooncake_rows())}
    dropped = w.describe()["trace"]["length_rule"]
    assert dropped["clipped"] > 0 and len(w) == len(rows)  # clipped, not dropped: every row is served
    config = EngineConfig.model_validate(
        {"kv_cache": {"block_size": block, "num_blocks": 2048, "prefix_caching": caching}}
    )
    engine = Engine(models["llama"], config=config)
    seen: list[list[int]] = []
    for req in w.requests:
        ids = req.token_ids(None)
        (out,) = engine.generate([ids], SamplingParams(max_new_tokens=req.max_new_tokens, ignore_eos=True))
        own = rows[req.request_id]["hash_ids"][: req.synthetic_prompt.tokens // block]
        shared = max((common_prefix(own, h) for h in seen), default=0)
        expect = min(shared * block, (len(ids) - 1) // block * block) if caching else 0
        assert out.metrics.prefix_cache_hits == expect, req.request_id
        seen.append(rows[req.request_id]["hash_ids"][: len(ids) // block])
    assert caching is False or sum(1 for h in seen[1:] if h[:1] == [0]) > 0


def test_the_real_engine_drives_a_trace_with_the_same_tokens_as_the_simulator(models) -> None:
    from cbcore.sim.executor import sim_engine
    from cbcore.sim.profile import load_profile

    w = load_workload(f"trace:path={MOONCAKE},length_scale=0.03125,max_output=3,overlong=clip,limit=4", VOCAB, SPECIAL, 512)
    real = drive([Engine(models["llama"], config=EngineConfig(), clock=VirtualClock())], "real", w,
                 prompt_token_ids(w, None))  # fmt: skip
    sim = drive([sim_engine(EngineConfig(), load_profile("a100-llama-2-7b-tp1"), VirtualClock())], "sim", w,
                prompt_token_ids(w, None, lazy=True))  # fmt: skip
    assert [list(o.prompt_token_ids) for o in real.outputs] == [list(o.prompt_token_ids) for o in sim.outputs]
    assert [len(o.output_token_ids) for o in real.outputs] == [r.max_new_tokens for r in w.requests]


# -- names, sweeps, specs -------------------------------------------------------------------------


def test_the_shipped_traces_are_read_by_name_with_the_published_counts() -> None:
    az = load_workload("azure-conv-2023", 32000)
    assert len(az) == 19366 and az.span_s == pytest.approx(3501.72, abs=0.01)
    over = sum(r.synthetic_prompt.tokens + r.max_new_tokens > 4096 for r in az.requests)
    assert over == 1612
    assert len(load_workload("azure-conv-2023", 32000, context=4096)) == 19366 - 1612
    assert len(load_workload("azure-conv-2023:duration_s=600", 32000)) == 2867
    mc = load_workload("mooncake-conversation", 128256)
    lengths = [r.synthetic_prompt.tokens for r in mc.requests]
    assert (len(mc), sum(n > 4096 for n in lengths), sum(n > 32768 for n in lengths)) == (12031, 7929, 828)
    clipped = load_workload("mooncake-conversation:max_input=32768,overlong=clip", 128256, context=34816)
    assert clipped.describe()["trace"]["length_rule"]["prompts_clipped"] == 828
    for name in ("azure-conv-2023", "mooncake-conversation"):
        folder = shipped_path(name).parent
        assert (folder / "README.md").exists() and list(folder.glob("LICENSE-*"))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("trace:limit=3", "trace needs path=FILE"),
        ("azure-conv-2023:path=x.csv", "azure-conv-2023 is a shipped trace"),
        ("azure-conv-2023:overlong=trim", "overlong"),
        ("azure-conv-2023:rate=0", "rate"),
        ("azure-conv-2023:limit=2,limit=3", "limit is given twice"),
        ("trace:path=/nonexistent/x.csv", "cannot read trace /nonexistent/x.csv"),
    ],
)
def test_bad_trace_specs_name_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        load_workload(spec, 32000)


def test_a_sweep_varies_a_trace_key() -> None:
    sweep = Sweep.parse("rate=4,8")
    assert sweep.points("azure-conv-2023:duration_s=60") == [
        "azure-conv-2023:duration_s=60,rate=4", "azure-conv-2023:duration_s=60,rate=8",
    ]  # fmt: skip
    assert Sweep.parse("max_input=100,200").points("mooncake-conversation") == [
        "mooncake-conversation:max_input=100", "mooncake-conversation:max_input=200",
    ]  # fmt: skip
    with pytest.raises(WorkloadError, match="burstiness: not a key of a trace workload"):
        Sweep.parse("burstiness=1,2").points("azure-conv-2023")
    with pytest.raises(WorkloadError, match="length_scale: not a key of a generator workload"):
        Sweep.parse("length_scale=1,2").points("poisson:n=10")


def test_cb_simulate_sweeps_a_trace_rate(tmp_path) -> None:
    out = tmp_path / "sweep.json"
    code = main([
        "simulate", "--profile", "a100-llama-2-7b-tp1", "--workload", f"trace:path={AZURE}", "--sweep", "rate=2,8",
        "--policy", "fcfs", "--no-progress", "--json", str(out),
    ])  # fmt: skip
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["sweep_value"] for r in rows] == [2.0, 8.0]
    assert [r["offered_request_rate"] for r in rows] == pytest.approx([2.0, 8.0])


def test_classes_are_drawn_per_row_and_stay_in_every_window() -> None:
    whole = azure("priorities=0:1/1:1,deadlines=0:2")
    part = azure("priorities=0:1/1:1,deadlines=0:2,start_s=3")
    by_id = {r.request_id: r for r in whole.requests}
    assert {r.priority for r in whole.requests} == {0, 1}
    for r in part.requests:
        assert (r.priority, r.deadline_s) == (by_id[r.request_id].priority, by_id[r.request_id].deadline_s)
    assert all((r.deadline_s is None) == (r.priority == 1) for r in whole.requests)


def test_a_bench_request_with_a_synthetic_prompt_validates_like_any_record() -> None:
    prompt = {"tokens": 5, "row": 0, "vocab_size": 50}
    req = BenchRequest.model_validate({"request_id": "a", "arrival_s": 0, "max_new_tokens": 1, "synthetic_prompt": prompt})
    assert len(req.token_ids(None)) == 5 and req.num_prompt_tokens == 5
    with pytest.raises(ValueError, match="exactly one of 'prompt' or 'messages'"):
        BenchRequest.model_validate(
            {"request_id": "a", "arrival_s": 0, "max_new_tokens": 1, "synthetic_prompt": prompt, "prompt": "hi"}
        )
