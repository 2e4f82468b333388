"""Loading a model and tokenizer from a directory or hub id, per ``ModelConfig``."""

from __future__ import annotations

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
