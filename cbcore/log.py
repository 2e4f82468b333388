"""Structured logging that behaves like a library should.

Loggers are structlog wrappers around stdlib loggers named ``cbcore.*``, so
nothing is printed unless the application configures logging (the ``cb`` CLI
does, in ``cbcore.cli.main``), and structlog's global configuration is left to
the application.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import structlog

#: One JSON object per line instead of ``event key=value`` text (the application sets it).
json_output = False


def _render(logger: Any, method: str, event: dict[str, Any]) -> str:
    if json_output:
        event.setdefault("level", method)
        return json.dumps(event, default=str)
    return " ".join([str(event.pop("event", "")), *(f"{k}={v}" for k, v in event.items())])


def get_logger(name: str) -> Any:
    return structlog.wrap_logger(
        logging.getLogger(name),
        # exc_info (an exception, or True in an except block) becomes the traceback, under "exception"
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.format_exc_info,
            _render,
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
    )
