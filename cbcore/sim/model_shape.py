"""The few numbers of a transformer that set its step cost and its KV footprint."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt


class ModelShape(BaseModel):
    """A decoder-only transformer, as far as cost and KV size go."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="For reports; not looked up anywhere.")
    num_layers: PositiveInt
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_heads: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt
    vocab_size: PositiveInt
    gated_mlp: bool = Field(True, description="SwiGLU-style MLP: gate and up projections.")
    max_position_embeddings: PositiveInt | None = None

    @classmethod
    def of(cls, name: str, config: Any) -> ModelShape:
        """From an HF model config (text part)."""
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        hidden = cfg.hidden_size
        intermediate = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * hidden
        act = str(getattr(cfg, "hidden_act", getattr(cfg, "activation_function", "")))
        return cls(
            name=name,
            num_layers=cfg.num_hidden_layers,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=getattr(cfg, "head_dim", None) or hidden // heads,
            vocab_size=cfg.vocab_size,
            gated_mlp=act in ("silu", "swiglu") or "llama" in str(getattr(cfg, "model_type", "")),
            max_position_embeddings=getattr(cfg, "max_position_embeddings", None),
        )

    def linear_layers(self) -> list[tuple[int, int]]:
        """(in, out) of each matrix of one layer: fused QKV, output, fused gate+up (or up), down."""
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        up = (2 if self.gated_mlp else 1) * self.intermediate_size
        return [
            (self.hidden_size, qkv),
            (self.num_heads * self.head_dim, self.hidden_size),
            (self.hidden_size, up),
            (self.intermediate_size, self.hidden_size),
        ]

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
