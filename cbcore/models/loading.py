"""Loading a model and tokenizer from a directory or hub id, per ``ModelConfig``, and what the engine
reads from a loaded model: its KV shape, its context length, the tokens that end a request."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cbcore.config import ModelConfig
from cbcore.log import get_logger
from cbcore.models import ModelLoadError

log = get_logger(__name__)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but torch sees no CUDA device")
    return dev


def resolve_dtype(dtype: str) -> torch.dtype | str:
    return "auto" if dtype == "auto" else getattr(torch, dtype)


def load_model_and_tokenizer(path: str | None, cfg: ModelConfig) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path is None:
        from cbcore.models.default_model import default_model_dir

        path = str(default_model_dir())
    device = resolve_device(cfg.device)
    local = Path(path).expanduser()
    if (path.startswith((".", "/", "~")) or local.exists()) and not local.is_dir():
        raise ModelLoadError(f"model path {path} does not exist or is not a directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(local) if local.is_dir() else path)
        model = AutoModelForCausalLM.from_pretrained(
            str(local) if local.is_dir() else path,
            dtype=resolve_dtype(cfg.dtype),
            trust_remote_code=cfg.trust_remote_code,
        )
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot load model {path!r}: {first}") from exc
    model.to(device).eval()
    log.info("model loaded", path=path, dtype=str(next(model.parameters()).dtype), device=str(device))
    return model, tokenizer


def eos_token_ids(model: Any) -> tuple[int, ...]:
    """The token ids that end a request (unless it ignores EOS): the generation config's, else the model config's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    return (eos,) if isinstance(eos, int) else tuple(eos or ())


@dataclass(frozen=True)
class KVGeometry:
    """The per-token KV shape a model needs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model: Any) -> KVGeometry:
        cfg = model.config.get_text_config()
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(cfg.num_hidden_layers, kv_heads, head_dim)


def check_model(model: Any, want: ModelConfig) -> int | None:
    """The context length to serve ``model`` with (None: unknown), checked against ``want``.

    An in-memory model is used as it is: an explicit ``model`` section that disagrees with it, or a
    ``max_model_len`` past its positions, is an error rather than a silent change.
    """
    param, explicit = next(model.parameters()), want.model_fields_set
    if "dtype" in explicit and want.dtype != "auto" and param.dtype != getattr(torch, want.dtype):
        raise ValueError(f"model.dtype is {want.dtype} but the model given is {param.dtype}")
    if "device" in explicit and torch.device(want.device).type != param.device.type:
        raise ValueError(f"model.device is {want.device} but the model given is on {param.device}")
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if want.max_model_len is not None and positions is not None and want.max_model_len > positions:
        raise ValueError(f"model.max_model_len is {want.max_model_len} but the model has only {positions} positions "
                         "(max_position_embeddings); lower it or leave it unset")  # fmt: skip
    return want.max_model_len or positions
