"""The attention Backend protocol.

A backend answers one question per layer: given this step's queries (the new
K/V are already written into the paged cache), attend each query token to its
own sequence's cached keys only, causally. Everything a backend needs about the
packed layout is on :class:`cbcore.batch.FlatBatch`; per-step work (masks,
plans) can be cached in ``batch.scratch`` on the first layer and reused.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import BaseModel

from cbcore.execution.batch import FlatBatch
from cbcore.execution.kv_cache import KVCache
from cbcore.plugins import NoParams


class BackendUnavailable(RuntimeError):
    """The selected backend cannot run here; the message says what is missing."""


class Backend:
    name: ClassVar[str]
    kind: ClassVar[str] = "backend"
    Params: ClassVar[type[BaseModel]] = NoParams
    #: Block sizes this backend's kernels accept (None: any).
    block_size_multiple: ClassVar[int | None] = None

    def __init__(self, params: BaseModel | None = None) -> None:
        self.params = params if params is not None else self.Params()

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        """None if usable on ``device``, else why not (shown by ``cb plugins`` and at engine start)."""
        return None

    def check(self, device: torch.device, block_size: int, dtype: torch.dtype) -> None:
        """Raise :class:`BackendUnavailable` if this backend cannot serve that setup."""
        if (reason := self.unavailable_reason(device)) is not None:
            raise BackendUnavailable(f"backend {self.name!r} is unavailable on {device}: {reason}")
        if (multiple := self.block_size_multiple) is not None and block_size % multiple:
            raise BackendUnavailable(
                f"backend {self.name!r} needs kv_cache.block_size to be a multiple of {multiple}, got {block_size}"
            )

    @property
    def variant(self) -> str | None:
        """Which of its code paths this backend runs, once :meth:`check` has decided (None: only one).

        Recorded with profiles and logged at start: two runs of one backend on
        different paths have different step costs.
        """
        return None

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, batch: FlatBatch,
        kv_cache: KVCache, scaling: float, sliding_window: int | None,
    ) -> torch.Tensor:  # fmt: skip
        """``query`` ``[T, num_heads, head_dim]``, ``key``/``value`` ``[T, num_kv_heads, head_dim]``
        (already in the cache); returns ``[T, num_heads, head_dim]``."""
        raise NotImplementedError
