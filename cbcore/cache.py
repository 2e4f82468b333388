"""Where cbcore keeps what it computes once per machine.

The converted default model (:mod:`cbcore.models.default_model`) and the linear
layers' product-order calibration (:mod:`cbcore.execution.linear_cache`) live
under one root: ``$CBCORE_CACHE_DIR``, else ``$XDG_CACHE_HOME/cbcore``, else
``~/.cache/cbcore``.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "CBCORE_CACHE_DIR"


def cache_root() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "cbcore"
