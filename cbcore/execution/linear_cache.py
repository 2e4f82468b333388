"""Where the linear layers' product-order calibration is remembered between processes.

Timed afresh at every engine build, the choice for row counts near the margin
differs from one process to the next on a machine whose speed drifts: two
processes that should be comparable (a ``cb profile`` and the ``cb bench`` it
is meant to predict, or two rows of a benchmark run one after another) then
run different kernels at 3-4 rows and those steps differ by 13-38 %. So the
first measurement is kept per machine, model shape, thread count, dtype and
torch version, and later engines on the same combination run that choice;
``execution.linear_calibration: fresh`` measures again and replaces it.

The file is ``linear-order.json`` in cbcore's cache directory
(:func:`cbcore.config.cache_root`). It is a cache: a file
that cannot be read is measured over (with a warning), one that cannot be
written only costs the next process its calibration time.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch import nn

from cbcore.config import cache_root
from cbcore.log import get_logger

log = get_logger(__name__)

FILE_NAME = "linear-order.json"


def hardware_name(device: torch.device | None = None) -> str:
    """The accelerator's or CPU's model name: what a timing measured here is valid for."""
    if device is not None and device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def calibration_key(modules: list[nn.Linear], method: str) -> str:
    """Names everything the measured choice depends on; ``method`` names the calibration itself."""
    shapes = ",".join(f"{m.in_features}x{m.out_features}" for m in modules)
    digest = hashlib.sha256(shapes.encode()).hexdigest()[:16]
    dtype = str(modules[0].weight.dtype).removeprefix("torch.") if modules else "-"
    return (
        f"{hardware_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads | {dtype} | "
        f"{len(modules)} linears {digest} | {method}"
    )


def _path() -> Path:
    return cache_root() / FILE_NAME


def _entries() -> dict[str, dict]:
    path = _path()
    if not path.exists():
        return {}
    try:
        entries = json.loads(path.read_text())["entries"]
        if not isinstance(entries, dict):
            raise TypeError("entries is not an object")
        return entries
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("linear calibration cache unreadable; measuring again", path=str(path), error=str(exc))
        return {}


def load_choice(key: str, orders: tuple[str, ...]) -> dict[int, str] | None:
    """The remembered row count -> order map, if there is a sound one using only ``orders``."""
    entry = _entries().get(key)
    if entry is None:
        return None
    chosen = entry.get("orders") if isinstance(entry, dict) else None
    try:
        parsed = {int(rows): order for rows, order in chosen.items()}  # type: ignore[union-attr]
    except (AttributeError, TypeError, ValueError):
        parsed = None
    if parsed is None or not all(rows > 0 and order in orders for rows, order in parsed.items()):
        log.warning("linear calibration cache entry malformed; measuring again", path=str(_path()), key=key)
        return None
    return parsed


def store_choice(key: str, orders: dict[int, str]) -> None:
    path = _path()
    entries = _entries()
    entries[key] = {
        "orders": {str(rows): orders[rows] for rows in sorted(orders)},
        "measured": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    tmp_name = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".linear-order.", delete=False) as tmp:
            tmp_name = tmp.name
            json.dump({"version": 2, "entries": entries}, tmp, indent=1)
        os.replace(tmp_name, path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError as exc:
        log.warning("linear calibration not cached", path=str(path), error=str(exc))
        if tmp_name is not None:
            Path(tmp_name).unlink(missing_ok=True)
