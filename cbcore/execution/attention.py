"""The bridge between transformers' attention layers and a cbcore Backend.

transformers lets a model's attention be any function registered in its
``AttentionInterface``. cbcore registers one, ``"cbcore"``, plus a mask
function that builds nothing (the backend owns masking). Per-step metadata
travels as keyword arguments of ``model(...)`` — ``cb_batch`` (the
:class:`FlatBatch`) and ``cb_attn`` (the runner, whose ``attend`` stores K/V and calls the backend) — which
transformers forwards to every attention call. No module-global state, so
several engines can share a process.

The model's own attention implementation is swapped in only for the duration
of an engine forward (:func:`routed_to_cbcore`), so ``model.generate()`` keeps
working normally outside the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from cbcore.execution.batch import FlatBatch

IMPLEMENTATION = "cbcore"

# Keyword arguments some architectures pass that change the attention math.
# Ignoring them would give silently wrong tokens, so they are refused instead.
_UNSUPPORTED = ("softcap", "s_aux", "sinks", "attention_chunk_size")


def cbcore_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
    cb_batch: FlatBatch | None = None, cb_attn: Any = None,
    sliding_window: int | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention call: ``query`` ``[1, H, T, D]``, ``key``/``value`` ``[1, Hkv, T, D]``."""
    if cb_batch is None or cb_attn is None:
        raise RuntimeError(
            "attention implementation 'cbcore' was called outside a cbcore engine step "
            "(no cb_batch); run the model through cbcore.Engine"
        )
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"{type(module).__name__} passes {name}={kwargs[name]!r}; cbcore backends do not implement it"
            )
    if query.shape[0] != 1:
        raise ValueError(f"cbcore packs every step into one row; got a batch of {query.shape[0]}")
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, heads, D]
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    return cb_attn.attend(cb_batch, q, k, v, module.layer_idx, sliding_window, scaling).unsqueeze(0), None


AttentionInterface.register(IMPLEMENTATION, cbcore_attention)
AttentionMaskInterface.register(IMPLEMENTATION, lambda *args, **kwargs: None)  # the backend owns masking


def check_model_supported(model: PreTrainedModel) -> None:
    """Fail early, with the reason, for models cbcore cannot drive."""
    if (can := getattr(model, "_can_set_attn_implementation", None)) is None or not can():
        raise ValueError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, "
            "so cbcore cannot attach its paged attention to it"
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder model; cbcore serves decoder-only models"
        )


@contextlib.contextmanager
def routed_to_cbcore(model: PreTrainedModel) -> Iterator[None]:
    """Route the model's attention to cbcore for one forward, then restore it."""
    previous = model.config._attn_implementation_internal
    model.config._attn_implementation_internal = IMPLEMENTATION
    try:
        yield
    finally:
        model.config._attn_implementation_internal = previous
