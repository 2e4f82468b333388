"""A signal that reaches vLLM's engine core during a policy call stays a shutdown.

vLLM's engine-core process turns SIGTERM and SIGINT into ``SystemExit`` in
handlers of its own. Raised while a policy runs, that ``SystemExit`` would
look like the policy's own (cbcore's door ends the request it concerned and
the engine goes on), and the shutdown would be lost. cbcore's door tells the
two apart by :data:`SIGNALLED`, which an application sets in its handler:
:func:`note_signals` wraps the handlers the process has, so that a signal sets
it before the handler runs.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from cbcore_vllm._cbcore import SIGNALLED

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def note_signals() -> None:
    """Wrap this process's Python handlers of SIGTERM and SIGINT (once) to set SIGNALLED first."""
    if threading.current_thread() is not threading.main_thread():
        return  # handlers can be set only there, and the engine core's are set there before the scheduler
    for signum in SIGNALS:
        handler = signal.getsignal(signum)
        if not callable(handler) or handler is signal.default_int_handler or getattr(handler, "notes_signalled", 0):
            continue  # no Python code runs; Python's own Ctrl-C, which the door knows; or wrapped already

        def noted(num: int, frame: FrameType | None, handler: Any = handler) -> Any:
            SIGNALLED.set()
            return handler(num, frame)

        noted.notes_signalled = True  # type: ignore[attr-defined]
        signal.signal(signum, noted)
