"""Structured logging that behaves like a library should.

Loggers are structlog wrappers around stdlib loggers named ``cbcore.*``, so
nothing is printed unless the application configures logging (the ``cb`` CLI
does, with :func:`configure_logging`), and structlog's global configuration is
left to the application.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import structlog

_json_output = False


def _render(logger: Any, method: str, event: dict[str, Any]) -> str:
    if _json_output:
        event.setdefault("level", method)
        return json.dumps(event, default=str)
    message = event.pop("event", "")
    return " ".join([str(message), *(f"{k}={v}" for k, v in event.items())])


def get_logger(name: str) -> Any:
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=[structlog.stdlib.filter_by_level, structlog.stdlib.add_logger_name, _render],
        wrapper_class=structlog.stdlib.BoundLogger,
    )


def configure_logging(level: str = "warning", json_output: bool = False) -> None:
    """Send ``cbcore`` logs to stderr at ``level``, as text or one JSON object per line."""
    global _json_output
    _json_output = json_output
    root = logging.getLogger("cbcore")
    root.setLevel(level.upper())
    root.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    fmt = "%(message)s" if json_output else "%(asctime)s %(levelname)-7s %(message)s"
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.propagate = False
    if level.lower() != "debug":
        import transformers

        transformers.logging.set_verbosity_error()
