"""Resident memory of this process while a benchmark row runs.

A row's peak is found by sampling the current resident set size from a
background thread (``/proc/self/statm``, every ``interval_s``), because the
kernel's own peak (``ru_maxrss``) only ever grows over the whole process and
so cannot tell one row from the next. Where ``/proc`` does not exist the row
peak is None and only the process peak is reported.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
from pathlib import Path
from types import TracebackType

_STATM = Path("/proc/self/statm")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss_bytes() -> int | None:
    """Resident set size now, or None where the platform does not expose it."""
    try:
        return int(_STATM.read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def process_peak_rss_bytes() -> int:
    """The kernel's high-water mark of this process's resident set."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


class PeakRSS:
    """``with PeakRSS() as rss: ...`` then ``rss.peak_bytes`` (None where it cannot be sampled)."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.peak_bytes: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        now = current_rss_bytes()
        if now is not None and (self.peak_bytes is None or now > self.peak_bytes):
            self.peak_bytes = now

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> PeakRSS:
        self._sample()
        if self.peak_bytes is not None:
            self._thread = threading.Thread(target=self._run, name="cbcore-rss", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
