"""Starting `cb serve` in a subprocess and waiting until it answers: for tests and `cb bench --serve`.

The server is started with ``--port 0`` and reports the port it bound on its
ready line, so nothing races for a free port.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from cbcore.serve.server import READY


class ServerProcess:
    """``with ServerProcess([...cb serve flags...]) as server: server.url``; SIGTERM on exit."""

    def __init__(
        self, args: list[str], *, startup_timeout_s: float = 300.0, env: dict[str, str] | None = None
    ):
        self.args = [sys.executable, "-m", "cbcore.cli.main", "serve", "--port", "0", *args]
        self.startup_timeout_s = startup_timeout_s
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self._log: IO[bytes] | None = None

    @property
    def log_path(self) -> Path:
        assert self._log is not None
        return Path(self._log.name)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self._log is not None else ""

    def start(self) -> ServerProcess:
        self._log = tempfile.NamedTemporaryFile(prefix="cb-serve-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=self._log, env=self.env)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            for line in self.log_text().splitlines():
                if line.startswith(READY):
                    self.url = line[len(READY) :].split()[0]
                    return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"cb serve exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(
            f"cb serve did not start within {self.startup_timeout_s:.0f} s:\n{self.log_text()[-3000:]}"
        )

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then wait; returns the exit code (SIGKILL and an error if it hangs)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"cb serve did not exit within {timeout_s:.0f} s of SIGTERM") from None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self._log is not None:
            self._log.close()
            os.unlink(self._log.name)
            self._log = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self.close()
