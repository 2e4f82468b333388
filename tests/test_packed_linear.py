"""The fused forward and its products: HF's numbers, the model left plain, refusals by name."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.models.packed_linear import (
    EXACT_ROWS,
    PACKED_ROWS,
    PAD_STEP,
    WHOLE_ROWS,
    Product,
    onednn_refusal,
    padded_rows,
    small_gemm_refusal,
    with_room,
)
from cbcore.testing.tiny_models import random_prompts, tiny_model

needs_onednn = pytest.mark.skipif(
    onednn_refusal(torch.zeros(2, 2)) is not None, reason="this torch build has no oneDNN linear"
)


needs_small_gemm = pytest.mark.skipif(
    small_gemm_refusal(torch.zeros(2, 2)) is not None, reason="small_gemm.c cannot run here"
)


def _config(linear: str = "auto", forward: str = "auto") -> EngineConfig:
    return EngineConfig.model_validate({"execution": {"linear": linear, "forward": forward}})


@needs_onednn
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "llama-with-a-stray-window"])
def test_the_fused_forward_gives_hf_modules_logits_and_leaves_the_model_plain(family):
    """Same step, both forwards: the logits agree to rounding; the model still computes what it did.

    HF's Llama ignores a ``sliding_window`` its config happens to hold; so must the fused forward.
    """
    model = tiny_model(family.removesuffix("-with-a-stray-window"))
    if family.endswith("window"):
        model.config.sliding_window = 3
    prompts = random_prompts(3, 5, 30, seed=4)
    before = model(torch.tensor([prompts[0]])).logits
    captured: dict[str, list[torch.Tensor]] = {"fused": [], "hf": []}
    for forward in ("fused", "hf"):
        engine = Engine(model, config=_config(forward=forward))
        assert engine.runner.model_forward == forward
        run = engine.runner.forward
        engine.runner.forward = lambda batch, run=run, into=captured[forward]: into.append(run(batch)) or into[-1]
        engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert len(captured["fused"]) == len(captured["hf"]) > 1
    for fused, hf in zip(captured["fused"], captured["hf"], strict=True):
        assert torch.allclose(fused, hf, atol=1e-4, rtol=1e-4)
    # The projections' weights are views of the joined tensors now: the same values, HF's forward unchanged.
    assert torch.allclose(model(torch.tensor([prompts[0]])).logits, before, atol=1e-5)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()


def test_auto_runs_hf_modules_for_other_architectures_and_fused_refuses_them_by_name():
    model = tiny_model("gpt2")
    engine = Engine(model, config=_config())
    assert (engine.runner.model_forward, engine.runner.linear) == ("hf", "standard")
    with pytest.raises(ValueError, match=r"execution.forward 'fused' cannot run this model: .*GPT2LMHeadModel"):
        Engine(model, config=_config(forward="fused"))
    with pytest.raises(ValueError, match=r"execution.linear 'onednn' \(it multiplies in the fused forward\) cannot run this model: .*GPT2"):
        Engine(model, config=_config(linear="onednn"))
    outs = engine.generate(random_prompts(2, 4, 12, seed=3), SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert all(len(o.output_token_ids) == 5 for o in outs)


@needs_onednn
def test_auto_packs_float32_weights_for_onednn():
    engine = Engine(tiny_model("llama"), config=_config())
    assert (engine.runner.model_forward, engine.runner.linear) == ("fused", "onednn")
    assert engine.runner.fused.warmed > 0


def test_any_row_count_reaches_onednn_as_one_of_few_shapes():
    """oneDNN caches a primitive per shape, megabytes each at a few hundred rows: a server seeing
    every row count must not grow one per count."""
    counts = {padded_rows(n) for n in range(1, PACKED_ROWS + 1)}
    assert all(n <= padded_rows(n) < n + PAD_STEP for n in range(1, PACKED_ROWS + 1))
    assert all(padded_rows(n) == n for n in range(1, EXACT_ROWS + 1))
    assert len(counts) == EXACT_ROWS + (PACKED_ROWS - EXACT_ROWS) // PAD_STEP == 46
    prefills = {padded_rows(n) for n in range(PACKED_ROWS + 1, WHOLE_ROWS + 1)}
    assert all(n <= padded_rows(n) < n + PACKED_ROWS for n in range(PACKED_ROWS + 1, WHOLE_ROWS + 1))
    assert len(prefills) == (WHOLE_ROWS - PACKED_ROWS) // PACKED_ROWS == 7


@needs_onednn
def test_products_beyond_the_packed_rows_never_reach_onednn_as_one_shape(monkeypatch):
    """Past PACKED_ROWS float32 goes to the BLAS, any row count, or to oneDNN as products of warmed row
    counts (whichever this machine runs faster), and bfloat16 always to oneDNN so: no oneDNN primitive
    per prompt length."""
    from cbcore.models import packed_linear

    packs_bf16 = torch.bfloat16 in packed_linear._packable()
    seen: list[int] = []
    mkldnn = torch.ops.mkldnn

    class Spy:
        def __getattr__(self, name):
            if name == "_linear_pointwise":
                return lambda x, *rest: seen.append(len(x)) or mkldnn._linear_pointwise(x, *rest)
            return getattr(mkldnn, name)

    weight = torch.randn(48, 32)
    by_blas, in_pieces = (Product(weight, None, True, prefill) for prefill in ("standard", "onednn"))
    bf16 = Product(torch.randn(48, 32, dtype=torch.bfloat16), None, onednn=True) if packs_bf16 else None
    monkeypatch.setattr(packed_linear.torch.ops, "mkldnn", Spy(), raising=False)
    for rows in (EXACT_ROWS + 1, PACKED_ROWS, PACKED_ROWS + 1, 1999):
        assert by_blas(torch.randn(rows, 32)).shape == (rows, 48)
    assert seen == [padded_rows(EXACT_ROWS + 1), PACKED_ROWS]
    seen.clear()
    packed_linear.warm([in_pieces], Product(torch.randn(8, 32), None, True))
    warmed = set(seen)  # the row counts made when the engine is built
    for rows, shapes in (
        (1999, [WHOLE_ROWS]),  # one product, padded: no join
        (1921, [WHOLE_ROWS]),
        (WHOLE_ROWS, [WHOLE_ROWS]),  # a full default budget
        (2 * WHOLE_ROWS + 300, [WHOLE_ROWS, WHOLE_ROWS, padded_rows(300)]),
    ):
        seen.clear()
        x = torch.randn(rows, 32)
        assert torch.allclose(in_pieces(x), F.linear(x, weight), atol=1e-5)
        assert seen == shapes
        assert set(seen) <= warmed, f"row counts {set(seen) - warmed} reach oneDNN without being warmed"
    if bf16 is not None:  # torch would give bfloat16's F.linear to oneDNN: warmed row counts instead
        seen.clear()
        x = torch.randn(600, 32, dtype=torch.bfloat16)
        assert torch.allclose(bf16(x).float(), F.linear(x.float(), bf16.weight.float()), atol=0.1, rtol=0.02)
        assert seen == [padded_rows(600)]


@needs_onednn
def test_an_input_with_room_is_padded_in_place_and_its_spare_rows_change_nothing(monkeypatch):
    """The fused forward's ops leave room for a product's padding (``with_room``): the product then
    multiplies the rows after the input in its storage instead of copying the input, whatever they hold."""
    from cbcore.models import packed_linear

    torch.manual_seed(0)
    weight, bias = torch.randn(48, 32), torch.randn(48)
    product = Product(weight, bias, True, "onednn")
    seen: list[torch.Tensor] = []
    mkldnn = torch.ops.mkldnn

    class Spy:
        def __getattr__(self, name):
            if name == "_linear_pointwise":
                return lambda x, *rest: seen.append(x) or mkldnn._linear_pointwise(x, *rest)
            return getattr(mkldnn, name)

    monkeypatch.setattr(packed_linear.torch.ops, "mkldnn", Spy(), raising=False)
    for rows in (21, 300, 1921):
        room = with_room(rows, 32, weight)
        room.new_empty(0).set_(room.untyped_storage()).fill_(float("nan"))  # the spare rows hold anything
        x = room.copy_(torch.randn(rows, 32))
        seen.clear()
        out = product(x)
        assert [len(t) for t in seen] == [padded_rows(rows)] and seen[0].data_ptr() == x.data_ptr()  # no copy
        assert out.shape == (rows, 48) and torch.allclose(out, F.linear(x, weight, bias), atol=1e-5)
        seen.clear()
        assert torch.allclose(product(x.clone()), out, atol=0) and seen[0].data_ptr() != x.data_ptr()  # no room: a copy


@needs_onednn
@pytest.mark.parametrize("rows", [1, 9, 128, 129, 256, 300, 520, 1800, 2050])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("prefill", ["standard", "onednn"])
def test_padded_and_blas_products_equal_the_plain_product(rows, bias, prefill):
    torch.manual_seed(rows)
    weight, b = torch.randn(48, 32), (torch.randn(48) if bias else None)
    x = torch.randn(rows, 32)
    out = Product(weight, b, True, prefill)(x)
    assert out.shape == (rows, 48) and out.is_contiguous()
    assert torch.allclose(out, F.linear(x, weight, b), atol=1e-5)
    assert torch.equal(Product(weight, b, onednn=False)(x), F.linear(x, weight, b))


@needs_onednn
@pytest.mark.parametrize("which", ["prefill", pytest.param("decode", marks=needs_small_gemm)])
def test_the_products_ways_are_timed_once_per_machine_and_kept(monkeypatch, tmp_path, which):
    """MKL's sgemm took 2.3x oneDNN's time on a Zen 5 EPYC and 0.9x on a Xeon; small_gemm.c 1.23x oneDNN's
    at 16 rows there and 0.95x on the Xeon: measured on the machine, not assumed from its vendor."""
    import types

    from cbcore.kernels import native
    from cbcore.models import packed_linear

    choose = getattr(packed_linear, f"{which}_products")
    kinds = getattr(packed_linear, f"{which.upper()}_KINDS")
    monkeypatch.setenv("CBCORE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(getattr(packed_linear, f"{which.upper()}_ENV"), raising=False)
    other = {"prefill": "decode", "decode": "prefill"}[which]
    monkeypatch.setenv(getattr(packed_linear, f"{other.upper()}_ENV"), "onednn")  # only this one is timed
    for fn in (packed_linear.prefill_products, packed_linear.decode_products):
        fn.cache_clear()
    try:
        chosen = choose()
        (entry,) = json.loads((tmp_path / "kernels" / native.CHOICES_FILE).read_text()).values()
        assert entry["chosen"] == chosen and set(entry["least_us"]) == set(kinds)
        product = Product(torch.randn(8, 8), None, onednn=True)
        assert (product.standard_prefill if which == "prefill" else product.small) == (chosen == kinds[0])
        choose.cache_clear()  # the next process reads the choice, times nothing
        monkeypatch.setattr(native, "time", types.SimpleNamespace(perf_counter=lambda: pytest.fail("timed again")))
        assert choose() == chosen
    finally:
        for fn in (packed_linear.prefill_products, packed_linear.decode_products):
            fn.cache_clear()


@needs_onednn
@pytest.mark.parametrize(
    ("prefill", "decode"), [pytest.param("standard", "small_gemm", marks=needs_small_gemm), ("onednn", "onednn")]
)
def test_long_prefills_and_decodes_are_token_exact_by_either_products(monkeypatch, prefill, decode):
    """Steps of more than PACKED_ROWS tokens (the tiny models' prompts are short: these are long), then
    decodes, through the fused forward, each way forced in turn: float32 greedy equals HF per prompt."""
    from cbcore.models import packed_linear
    from cbcore.testing import assert_equivalent, compare_greedy, reference_generate

    monkeypatch.setenv(packed_linear.PREFILL_ENV, prefill)
    monkeypatch.setenv(packed_linear.DECODE_ENV, decode)
    packed_linear.prefill_products.cache_clear()
    packed_linear.decode_products.cache_clear()
    try:
        model, prompts = tiny_model("llama"), random_prompts(6, 70, 120, seed=7)
        config = EngineConfig.model_validate({"scheduler": {"budget": {"max_num_batched_tokens": 1024}}})
        engine = Engine(model, config=config)
        head = engine.runner.fused.head
        assert (head.standard_prefill, head.small) == (prefill == "standard", decode == "small_gemm")
        widest = []
        forward = engine.runner.forward
        engine.runner.forward = lambda batch: widest.append(len(batch.input_ids)) or forward(batch)
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert max(widest) > PACKED_ROWS
        assert_equivalent(compare_greedy(model, outputs, reference_generate(model, prompts, 8, ignore_eos=True)))
    finally:
        packed_linear.prefill_products.cache_clear()
        packed_linear.decode_products.cache_clear()


@pytest.mark.parametrize(
    ("env", "value", "chosen"),
    [("PREFILL", "standard", "standard"), ("PREFILL", " ONEDNN ", "onednn"), ("PREFILL", "mkl", None),
     pytest.param("DECODE", "small_gemm", "small_gemm", marks=needs_small_gemm),
     ("DECODE", "onednn", "onednn"), ("DECODE", "blas", None)],
)  # fmt: skip
def test_the_products_ways_forced_by_the_environment_and_a_bad_value_named(monkeypatch, env, value, chosen):
    from cbcore.models import packed_linear

    name = getattr(packed_linear, f"{env}_ENV")
    choose = getattr(packed_linear, f"{env.lower()}_products")
    monkeypatch.setenv(name, value)
    choose.cache_clear()
    try:
        if chosen is None:
            kinds = ", ".join(getattr(packed_linear, f"{env}_KINDS"))
            with pytest.raises(ValueError, match=rf"\${name}='{value}': expected auto, {kinds}$"):
                choose()
        else:
            assert choose() == chosen
    finally:
        choose.cache_clear()


def test_forcing_small_gemm_where_it_cannot_run_is_an_error_naming_why(monkeypatch):
    from cbcore.models import packed_linear

    monkeypatch.setenv(packed_linear.DECODE_ENV, "small_gemm")
    monkeypatch.setattr(packed_linear, "small_gemm_refusal", lambda weight: "no C compiler found")
    packed_linear.decode_products.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"CBCORE_DECODE_PRODUCTS=small_gemm: .*cannot run here: no C compiler"):
            packed_linear.decode_products()
    finally:
        packed_linear.decode_products.cache_clear()


@needs_onednn
def test_onednn_refuses_weights_it_cannot_pack_naming_them():
    model = tiny_model("llama", dtype=torch.float16)
    with pytest.raises(ValueError, match=r"execution.linear 'onednn' cannot run here: .*torch.float16"):
        Engine(model, config=_config("onednn"))
    assert Engine(model, config=_config("auto")).runner.linear == "standard"  # auto: the plain product


@pytest.mark.parametrize(("field", "value"), [("linear", "skinny"), ("forward", "compiled")])
def test_an_unknown_kind_is_a_config_error(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig.model_validate({"execution": {field: value}})


@needs_small_gemm
@pytest.mark.parametrize(("n", "k"), [(48, 64), (37, 21), (3, 8)])  # rows and depth off the kernel's blocks
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_small_row_kernel_multiplies_like_torch_and_each_row_alone(n, k, with_bias):
    torch.manual_seed(n + k)
    weight, bias = torch.randn(n, k), torch.randn(n) if with_bias else None
    product = Product(weight, bias, True, decode="small_gemm")
    assert product.small
    x = torch.randn(EXACT_ROWS, k)
    for rows in range(1, EXACT_ROWS + 1):
        got = product(x[:rows])
        torch.testing.assert_close(got, F.linear(x[:rows], weight, bias), atol=1e-5, rtol=1e-5)
    # A row's result does not depend on which other rows share the step.
    alone = torch.cat([product(x[i : i + 1]) for i in range(EXACT_ROWS)])
    assert torch.equal(product(x), alone)
    assert small_gemm_refusal(weight.double()) is not None


def test_every_projection_and_the_head_become_views_of_one_buffer_with_their_values(monkeypatch):
    """The decode products stream their weights from one buffer (on 2 MiB pages where the kernel
    grants them); the model keeps its values and its tied embedding, and a refusal is named."""
    from cbcore.models import fused_decoder

    model = tiny_model("llama")
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as the default model's are
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    prompt = random_prompts(1, 9, 10, seed=2)[0]
    expected = model(torch.tensor([prompt])).logits
    engine = Engine(model, config=_config())
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len({w.untyped_storage().data_ptr() for w in linears}) == 1
    assert engine.runner.fused.head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert torch.equal(model(torch.tensor([prompt])).logits, expected)
    assert engine.runner.fused.weight_pages in ("2 MiB", "4 KiB")
    monkeypatch.setattr(fused_decoder.WeightArena, "__init__", _refused_arena)
    assert Engine(tiny_model("llama"), config=_config()).runner.fused.weight_pages == "4 KiB"


def _refused_arena(self, numel, dtype):
    self.buffer, self.why_small, self._used = torch.empty(numel, dtype=dtype), "no huge pages here", 0


def test_huge_pages_the_kernel_keeps_off_are_named_not_claimed(monkeypatch, tmp_path):
    from cbcore.models import weight_arena

    policy = tmp_path / "enabled"
    policy.write_text("always madvise [never]\n")
    monkeypatch.setattr(weight_arena, "THP_POLICY", str(policy))
    arena = weight_arena.WeightArena(1000, torch.float32)
    assert arena.why_small is not None and "[never]" in arena.why_small
    monkeypatch.setattr(weight_arena, "THP_POLICY", str(tmp_path / "missing"))
    assert weight_arena.advise_huge_pages(arena.buffer) == "this kernel has no transparent huge pages"
    assert arena.take(10, 100).shape == (10, 100)
    with pytest.raises(ValueError, match="more than the 1000 elements planned"):
        arena.take(1, 1)
