"""Run one test script in fresh processes, one per mode, side by side: what a process counts of itself
(page faults, threads) is its own, so the modes need not take turns."""

from __future__ import annotations

import subprocess
import sys


def last_line_of_each(script: str, *modes: str) -> list[list[int]]:
    """The integers on the last line ``script`` prints, for each mode (passed as ``sys.argv[1]``)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, m], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for m in modes
    ]
    lines = []
    for mode, proc in zip(modes, procs, strict=True):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{mode}: {err[-2000:]}"
        lines.append([int(word) for word in out.strip().splitlines()[-1].split()])
    return lines
