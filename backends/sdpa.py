"""SDPA backend: torch's fused attention kernel, run per sequence over the paged cache.

Eager scores every query against every gathered key and masks most of the
result away (work O(T x K)). Here each sequence only meets its own keys:

- decode rows (one query each), on the CPU in float32, read their keys and
  values straight out of the block pool through their block tables
  (:mod:`cbcore.kernels.paged_decode`, a small compiled kernel): nothing is
  copied, where the general path below copies every row's keys on every
  layer, which at 32 rows of 1,024 tokens costs more than the attention;
- elsewhere (a GPU, half precision, ``decode: gather``) decode rows are
  batched as ``[B, kv_heads, group, D]`` against their own keys, gathered and
  right-padded to the longest, with a key-padding mask ``[B, 1, 1, L]``; the
  query heads that share a KV head ride in the query-length axis, so K/V are
  never repeated and no ``T x K`` mask exists;
- whole prompts (no prior context, no window cutting them), on the CPU in
  float32, all run in one call per layer of another small kernel
  (:mod:`cbcore.kernels.prompt_attention`), which reads the step's own keys
  and values in place: SDPA's CPU kernel reaches a quarter of the machine's
  rate at 128 x 128 per head;
- other prefill and chunk rows run one sequence at a time. A whole prompt
  is the square causal case (``is_causal=True``, no mask); a chunk after
  earlier context needs the causal diagonal aligned to the bottom right
  (SDPA's ``is_causal`` is top-left aligned), so it gets a small ``[q, k]``
  mask of its own.

With a sliding window ``W`` a query at position ``i`` sees keys ``j`` with
``i - W < j <= i``, and keys that no query of the step can see are not even
gathered. The plan (slots, masks) is built once per step on the first layer
and cached in ``batch.scratch``; every layer only gathers its own K/V.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from cbcore.execution.backend import Backend, BackendUnavailable
from cbcore.execution.batch import FlatBatch
from cbcore.execution.kv_cache import KVCache
from cbcore.kernels import paged_decode, prompt_attention
from cbcore.kernels.paged_decode import PagedRows
from cbcore.kernels.prompt_attention import Prompts
from cbcore.log import get_logger
from cbcore.models.packed_linear import with_room

log = get_logger(__name__)


class SdpaParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    decode: Literal["auto", "paged", "gather"] = Field(
        "auto",
        description="How decode rows read their keys. paged: in place in the block pool (CPU, float32, "
        "built with the machine's C compiler on first use; whole prompts then run in one kernel call too); "
        "gather: copied into a padded tensor for SDPA, and prompts run in SDPA; auto: paged where it "
        "applies, else gather (with a warning when only the compiler is missing).",
    )


class GatheredRows(NamedTuple):
    """Decode rows' keys as SDPA wants them: copied out of the pool, right-padded."""

    slots: torch.Tensor  # [B, L] cache slots of each row's visible keys, right-padded
    mask: torch.Tensor | None  # [B, 1, 1, L] additive key-padding mask; None: no padding


class DecodePlan(NamedTuple):
    """All single-token rows of a step, batched."""

    rows: torch.Tensor | None  # [B] rows of T (None: every row, in order)
    keys: GatheredRows | PagedRows


class SpanPlan(NamedTuple):
    """One sequence running several query tokens this step (a prompt or a chunk of one)."""

    q_start: int  # its rows in T: [q_start, q_end)
    q_end: int
    fresh: bool  # every visible key was computed this step: read them from k/v, not the cache
    slots: torch.Tensor | None  # [n_keys] cache slots of its visible keys (None when fresh)
    mask: torch.Tensor | None  # [q, n_keys] additive; None: square causal (is_causal=True)


class SdpaPlan(NamedTuple):
    decode: DecodePlan | None
    spans: list[SpanPlan]
    prompts: Prompts | None = None  # whole prompts for the CPU kernel (paged plans only)


def visible_key_range(context_len: int, query_len: int, sliding_window: int | None) -> tuple[int, int]:
    """First and one-past-last key position that any query of this sequence may see this step."""
    if sliding_window is None:
        return 0, context_len
    return max(0, context_len - query_len - sliding_window + 1), context_len


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as SDPA's additive one, in the query dtype (built once, used by every layer)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of ``positions`` (``[..., n]``) through block table rows (``[..., max_blocks]``)."""
    return torch.gather(block_table, -1, positions // block_size) * block_size + positions % block_size


def build_decode_plan(
    batch: FlatBatch, seq_ids: list[int], sliding_window: int | None, dtype: torch.dtype, paged: bool
) -> DecodePlan:
    """Where each single-token row's visible keys lie (paged), or their padded slots and mask (gathered)."""
    device = batch.input_ids.device
    ranges = [visible_key_range(batch.context_lens[i], 1, sliding_window) for i in seq_ids]
    starts, counts = [lo for lo, _ in ranges], [hi - lo for lo, hi in ranges]
    start, count = (torch.tensor(x, dtype=torch.long, device=device) for x in (starts, counts))
    whole = len(seq_ids) == len(batch.query_lens)  # every row decodes: no row index needed
    rows = None if whole else batch.cu_seqlens_q.long()[torch.tensor(seq_ids, device=device)]
    if paged:  # the CPU kernels (start and count are on the CPU too)
        tables = batch.block_tables if rows is None else batch.block_tables[torch.tensor(seq_ids)]
        return DecodePlan(rows, PagedRows(tables.contiguous(), start, count, batch.block_size))
    # Gathered: right-padded key slots per row, and the padding mask if lengths differ. The mask is
    # additive and already in the query dtype: SDPA would convert a boolean mask on every call, this
    # one is built once and used by every layer.
    width = max(counts)
    offsets = torch.arange(width, device=device)[None, :]
    valid = offsets < count[:, None]
    # Padding reuses the row's first key: a real slot, masked out below.
    positions = start[:, None] + torch.where(valid, offsets, 0)
    tables = batch.block_tables.long()[torch.tensor(seq_ids, device=device)]
    mask = _additive(valid, dtype)[:, None, None, :] if min(counts) != width else None
    return DecodePlan(rows, GatheredRows(_slots(tables, positions, batch.block_size), mask))


def build_span_plan(
    batch: FlatBatch, i: int, q_start: int, sliding_window: int | None, dtype: torch.dtype
) -> SpanPlan:
    """Sequence ``i`` running several queries: which keys to read, and a mask unless plain causal."""
    q_len, ctx = batch.query_lens[i], batch.context_lens[i]
    fresh = ctx == q_len
    if fresh and (sliding_window is None or sliding_window >= ctx):  # a whole prompt, no window: is_causal
        return SpanPlan(q_start, q_start + q_len, fresh, None, None)
    k_pos = torch.arange(*visible_key_range(ctx, q_len, sliding_window), device=batch.device)
    slots = None if fresh else _slots(batch.block_tables.long()[i], k_pos, batch.block_size)
    q_pos = torch.arange(ctx - q_len, ctx, device=batch.device)[:, None]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= q_pos - k_pos < sliding_window
    return SpanPlan(q_start, q_start + q_len, fresh, slots, _additive(allowed, dtype))


def build_plan(batch: FlatBatch, sliding_window: int | None, dtype: torch.dtype, paged: bool) -> SdpaPlan:
    """Everything about a step's attention layout that every layer shares (``paged``: the CPU kernels run)."""
    decode_ids = [i for i, q in enumerate(batch.query_lens) if q == 1]
    decode = build_decode_plan(batch, decode_ids, sliding_window, dtype, paged) if decode_ids else None
    spans, whole, q_start = [], [], 0
    for i, q_len in enumerate(batch.query_lens):
        if q_len > 1:
            span = build_span_plan(batch, i, q_start, sliding_window, dtype)
            if paged and span.mask is None:  # square causal: the kernel takes every such prompt at once
                whole.append((q_start, q_len))
            else:
                spans.append(span)
        q_start += q_len
    return SdpaPlan(decode, spans, Prompts.of(whole, q_start) if whole else None)


class SdpaBackend(Backend):
    """``scaled_dot_product_attention`` per sequence; work ∝ Σ q_len x own keys."""

    name = "sdpa"
    Params = SdpaParams
    _paged: bool | None = None  # decided by check()

    def check(self, device: torch.device, block_size: int, dtype: torch.dtype) -> None:
        super().check(device, block_size, dtype)
        self._paged = self._use_paged_kernel(torch.device(device), dtype)

    @property
    def variant(self) -> str | None:
        if self._paged is None:
            return None
        return "decode paged" if self._paged else "decode gather"

    def _use_paged_kernel(self, device: torch.device, dtype: torch.dtype) -> bool:
        mode, cpu_float32 = self.params.decode, device.type == "cpu" and dtype == torch.float32
        if mode == "paged" and not cpu_float32:
            raise BackendUnavailable(
                f"backend 'sdpa' with decode='paged' runs on the CPU in float32, the model is {dtype} on "
                f"{device}; use decode='auto' or 'gather'"
            )
        if mode == "gather" or not cpu_float32:
            return False
        if (reason := paged_decode.unavailable_reason() or prompt_attention.unavailable_reason()) is None:
            return True
        if mode == "paged":
            raise BackendUnavailable(f"backend 'sdpa' with decode='paged': {reason}")
        log.warning("sdpa decode gathers keys: the paged CPU kernel is unavailable", reason=reason)
        return False

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, batch: FlatBatch,
        kv_cache: KVCache, scaling: float, sliding_window: int | None,
    ) -> torch.Tensor:  # fmt: skip
        if self._paged is None:
            self.check(query.device, kv_cache.block_size, query.dtype)
        plan = self.plan(batch, sliding_window, query.dtype, bool(self._paged))
        k_pool, v_pool = kv_cache.k[layer_idx], kv_cache.v[layer_idx]  # [slots, Hkv, D]
        if plan.decode is not None and plan.decode.rows is None:
            return self._decode(query, k_pool, v_pool, plan.decode, scaling)
        out = with_room(len(query), query[0].numel(), query).view(query.shape)  # the o product pads it in place
        if plan.prompts is not None:
            prompt_attention.prompt_attention(query, key, value, out, plan.prompts, scaling)
        if plan.decode is not None:
            rows = plan.decode.rows
            decoded = self._decode(query.index_select(0, rows), k_pool, v_pool, plan.decode, scaling)
            out.index_copy_(0, rows, decoded)
        for span in plan.spans:
            span_rows = slice(span.q_start, span.q_end)
            if span.fresh:
                k, v = key[span_rows], value[span_rows]
            else:
                k, v = k_pool.index_select(0, span.slots), v_pool.index_select(0, span.slots)
            q = query[span_rows].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            k = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, n_keys, D]
            v = v.transpose(0, 1).unsqueeze(0)
            out[span_rows] = F.scaled_dot_product_attention(
                q, k, v, attn_mask=span.mask, is_causal=span.mask is None, scale=scaling,
                enable_gqa=q.shape[1] != k.shape[1],
            )[0].transpose(0, 1)  # fmt: skip
        return out

    @staticmethod
    def plan(batch: FlatBatch, sliding_window: int | None, dtype: torch.dtype, paged: bool) -> SdpaPlan:
        key = ("sdpa", sliding_window, dtype, paged)
        if (plan := batch.scratch.get(key)) is None:
            plan = batch.scratch[key] = build_plan(batch, sliding_window, dtype, paged)
        return plan

    @staticmethod
    def _decode(
        query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: DecodePlan, scaling: float
    ) -> torch.Tensor:
        keys = plan.keys
        if isinstance(keys, PagedRows):
            return paged_decode.paged_decode(query.contiguous(), k_pool, v_pool, keys, scaling)
        num_rows, num_heads, head_dim = query.shape
        num_kv_heads = k_pool.shape[1]
        # [B, Hkv, G, D]: the group's query heads share one KV head's keys and one mask row.
        q = query.reshape(num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
        flat = keys.slots.view(-1)
        shape = (num_rows, keys.slots.shape[1], num_kv_heads, head_dim)
        k = k_pool.index_select(0, flat).view(shape).transpose(1, 2)  # [B, Hkv, L, D]
        v = v_pool.index_select(0, flat).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keys.mask, scale=scaling)
        return out.reshape(num_rows, num_heads, head_dim)
