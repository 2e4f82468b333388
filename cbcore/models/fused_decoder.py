"""cbcore's own forward for the Llama family (Llama, Mistral, Qwen2): the packed step without HF's modules.

HF's modules run a step op by op through about a dozen module calls per
layer (norm, three projections, rotary, the attention interface, the MLP's
three projections), each with its keyword plumbing: on the default model at
one decoding sequence that Python was about a quarter of the step. This
forward does the same arithmetic with fewer calls: q, k and v come from one
product and gate and up from another (the model's weights become views of
one tensor each, so nothing is copied and ``generate()`` sees the same
model), the norms, rotary and activation are one C call each where the
kernel runs (:mod:`cbcore.models.decoder_ops`; else HF's ops in HF's
order), and attention is the configured backend over the paged cache.

Only the exact HF classes below run here: a subclass or another architecture
may change the math anywhere, so it runs HF's modules (``execution.forward``
says which, and ``fused`` refuses, naming why).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import LlamaForCausalLM, MistralForCausalLM, PreTrainedModel, Qwen2ForCausalLM

from cbcore.execution.batch import FlatBatch
from cbcore.log import get_logger
from cbcore.models.decoder_ops import NativeOps, TorchOps, native_refusal
from cbcore.models.packed_linear import Product, small_gemm_refusal, warm
from cbcore.models.weight_arena import WeightArena

log = get_logger(__name__)

#: The classes the fused forward runs, and the sliding window each passes HF's attention for a layer:
#: Llama none (whatever its config holds), Mistral the config's, Qwen2 the layer's own.
WINDOWS: dict[type, Callable[[nn.Module, Any], int | None]] = {
    LlamaForCausalLM: lambda attn, config: None,
    MistralForCausalLM: lambda attn, config: getattr(config, "sliding_window", None),
    Qwen2ForCausalLM: lambda attn, config: attn.sliding_window,
}
FAMILY = tuple(WINDOWS)


def fused_refusal(model: PreTrainedModel) -> str | None:
    """Why this model cannot run the fused forward, or None."""
    if type(model) not in FAMILY:
        names = ", ".join(cls.__name__ for cls in FAMILY)
        return f"it covers {names} exactly; this model is {type(model).__name__}"
    return None


def _joined(modules: list[nn.Linear], onednn: bool, arena: WeightArena | None) -> Product:
    """One product for one or several projections of the same input: their weights become views of one
    tensor (in ``arena`` when given), so nothing is kept twice and ``generate()`` sees the same model."""
    with torch.no_grad():
        rows, cols = sum(m.weight.shape[0] for m in modules), modules[0].weight.shape[1]
        weight = arena.take(rows, cols) if arena is not None else modules[0].weight.new_empty(rows, cols)
        torch.cat([m.weight for m in modules], out=weight)
        biases = [m.bias for m in modules]
        bias = torch.cat(biases) if all(b is not None for b in biases) else None
        if any(b is not None for b in biases) and bias is None:
            raise ValueError("projections with and without bias cannot be joined")
        start = 0
        for m in modules:
            rows = m.weight.shape[0]
            m.weight.data = weight[start : start + rows]
            if bias is not None:
                m.bias.data = bias[start : start + rows]
            start += rows
    return Product(weight, bias, onednn)


class _Layer:
    __slots__ = ("act", "down", "gate_up", "norm1", "norm2", "o", "qkv", "scaling", "window")

    def __init__(
        self, layer: nn.Module, config: Any, window: Callable[[nn.Module, Any], int | None], onednn: bool,
        arena: WeightArena | None,
    ) -> None:  # fmt: skip
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1, self.norm2 = layer.input_layernorm, layer.post_attention_layernorm
        self.qkv = _joined([attn.q_proj, attn.k_proj, attn.v_proj], onednn, arena)
        self.o = _joined([attn.o_proj], onednn, arena)
        self.gate_up = _joined([mlp.gate_proj, mlp.up_proj], onednn, arena)
        self.down = _joined([mlp.down_proj], onednn, arena)
        self.act: Callable[[torch.Tensor], torch.Tensor] = mlp.act_fn
        self.scaling = attn.scaling
        self.window = window(attn, config)


class FusedDecoder:
    """The forward of one step for a Llama-family model: logits ``[S, vocab]`` of the sampling rows."""

    def __init__(self, model: PreTrainedModel, onednn: bool, native: bool = True) -> None:
        """``model`` must be of :data:`FAMILY` (:func:`fused_refusal`); ``native=False``: HF's own ops."""
        config = model.config
        inner = model.model
        self.embed, self.rotary, self.norm = inner.embed_tokens, inner.rotary_emb, inner.norm
        weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
        arena = None
        if weights[0].device.type == "cpu":  # every projection and the head, on huge pages (see weight_arena)
            arena = WeightArena(sum(w.numel() for w in weights), weights[0].dtype)
        self.weight_pages = "4 KiB" if arena is None or arena.why_small else "2 MiB"
        self.layers = [_Layer(layer, config, WINDOWS[type(model)], onednn, arena) for layer in inner.layers]
        self.head = _joined([model.lm_head], onednn, arena)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        products = [p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        self.warmed, self.warm_s = warm(products, self.head)
        why_torch = native_refusal(model, self.head_dim) if native else "asked for"
        self.ops: type[NativeOps] | type[TorchOps] = NativeOps if why_torch is None else TorchOps
        log.info(
            "fused forward kernels",
            glue=self.ops.name,
            weight_pages=self.weight_pages,
            why_small_pages=None if arena is None else arena.why_small,
            why_torch=why_torch if native else None,
            decode_products="small_gemm" if self.head.small else ("onednn" if onednn else "standard"),
            prefill_products="onednn" if onednn and not self.head.standard_prefill else "standard",
            why_onednn=small_gemm_refusal(self.head.weight) if onednn and not self.head.small else None,
        )

    @torch.inference_mode()
    def __call__(self, batch: FlatBatch, attention: Callable[..., torch.Tensor]) -> torch.Tensor:
        """``attention(q, k, v, layer, window, scaling)`` stores this step's keys and values and attends
        (:meth:`cbcore.execution.runner.ModelRunner.attend`)."""
        heads, kv_heads, dim, ops = self.heads, self.kv_heads, self.head_dim, self.ops
        q_end, k_end = heads * dim, (heads + kv_heads) * dim
        h = self.embed(batch.input_ids)
        tokens = len(h)
        cos, sin = self.rotary(h[None], batch.positions[None])
        cos, sin = cos[0], sin[0]
        delta: torch.Tensor | None = None  # what the previous layer adds to h
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(ops.add_norm(h, delta, layer.norm1))
            qk = ops.rotate(qkv[:, :k_end].view(tokens, heads + kv_heads, dim), cos, sin)  # q and k as one
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, k_end:].view(tokens, kv_heads, dim)
            out = attention(q, k, v, index, layer.window, layer.scaling).reshape(tokens, q_end)
            delta = layer.down(ops.silu_mul(layer.gate_up(ops.add_norm(h, layer.o(out), layer.norm2)), layer.act))
        rows = batch.logits_indices
        delta = None if delta is None else delta.index_select(0, rows)
        return self.head(ops.add_norm(h.index_select(0, rows), delta, self.norm))
