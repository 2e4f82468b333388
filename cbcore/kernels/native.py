"""cbcore's own C kernels: compiled on first use for this CPU, cached, loaded with ctypes.

A kernel is one C file beside this module (and the headers there, which it
may include). It is compiled with the machine's C compiler (``$CC``, else
``cc``) for this CPU (``-march=native``) and kept under cbcore's cache
directory, named by a hash of the sources, the flags, the compiler and the
CPU model, so a later process loads it in milliseconds and a
changed CPU or source builds anew. It is linked against the OpenMP runtime
torch has already loaded, so its threads are torch's threads. ctypes rather
than a torch extension: no torch headers, no pybind, a build of a fraction of
a second instead of a minute. Where no compiler is found or the build fails,
:meth:`NativeKernel.load` says why, and the caller decides what to run instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from cbcore.config import cache_root
from cbcore.log import get_logger

log = get_logger(__name__)

FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")


class KernelUnavailable(RuntimeError):
    """A C kernel could not be built or loaded here; the message says why."""


def hardware_name(device: torch.device | None = None) -> str:
    """The accelerator's or CPU's model name: what a kernel built or a timing measured here is valid for."""
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


def _compiler() -> str | None:
    explicit = os.environ.get("CC")
    if explicit:
        return shutil.which(explicit)
    return shutil.which("cc") or shutil.which("gcc")


def _library_path(source: Path, compiler: str) -> Path:
    identity = "\n".join([compiler, " ".join(FLAGS), hardware_name(), platform.machine()]).encode()
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what it may include
    digest = hashlib.sha256(source.read_bytes() + headers + b"\0" + identity).hexdigest()[:16]
    return cache_root() / "kernels" / f"{source.stem}-{digest}.so"


def _build(source: Path, compiler: str, target: Path) -> None:
    """Compile into a temporary file beside ``target``, then rename: concurrent builders never see half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{source.stem}.", suffix=".so")
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *FLAGS, str(source), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=300
        )
        if result.returncode != 0:
            raise KernelUnavailable(
                f"{compiler} could not build {source.name} (exit {result.returncode}): "
                f"{result.stderr.strip()[-600:]}"
            )
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)


class NativeKernel:
    """One C function of one kernel file, built or loaded once per process on first use (a build is a
    subprocess, a load a dlopen)."""

    def __init__(self, source: Path, symbol: str, argtypes: list) -> None:
        self.source, self.symbol, self.argtypes = source, symbol, argtypes
        self._loaded: tuple[ctypes._CFuncPtr | None, str] | None = None

    def load(self) -> tuple[ctypes._CFuncPtr | None, str]:
        """The function and where it came from (``built ...`` / ``cached ...``), or ``(None, why not)``."""
        if self._loaded is None:
            self._loaded = self._load()
        return self._loaded

    def _load(self) -> tuple[ctypes._CFuncPtr | None, str]:
        source = self.source
        if not source.exists():
            return None, f"{source} is missing from the installation"
        compiler = _compiler()
        if compiler is None:
            return None, f"no C compiler found ({os.environ.get('CC') or 'cc'!r} is not on PATH; install gcc or set $CC)"
        target = _library_path(source, compiler)
        origin = f"cached {target}"
        try:
            if not target.exists():
                try:
                    _build(source, compiler, target)
                except OSError as exc:  # an unwritable cache: build where this process may write
                    log.warning("kernel cache not writable; building in a temporary directory", error=str(exc))
                    target = Path(tempfile.mkdtemp(prefix="cbcore-kernels-")) / target.name
                    _build(source, compiler, target)
                origin = f"built {target}"
            fn = getattr(ctypes.CDLL(str(target)), self.symbol)
        except (KernelUnavailable, OSError, subprocess.SubprocessError, AttributeError) as exc:
            return None, str(exc)
        fn.argtypes, fn.restype = self.argtypes, ctypes.c_int
        log.debug("native kernel", symbol=self.symbol, origin=origin)
        return fn, origin

    @functools.cached_property
    def fn(self) -> ctypes._CFuncPtr:
        """The loaded function, resolved once (a later call costs one attribute read), else KernelUnavailable."""
        fn, text = self.load()
        if fn is None:
            raise KernelUnavailable(text)
        return fn

    def unavailable_reason(self) -> str | None:
        """None if the kernel is loaded (building it on first call), else why it cannot be."""
        fn, text = self.load()
        return None if fn is not None else text

    def forget(self) -> None:
        """Decide again on the next call (after a change of ``$CC`` or of the cache directory)."""
        self._loaded = None


#: glibc's ``mallopt`` parameters: below this size an allocation comes from the heap; what is freed stays.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_BLOCK_BYTES = 32 * 2**20  # glibc's largest heap allocation (HEAP_MAX_SIZE / 2 on 64-bit)


def hold_freed_memory() -> str | None:
    """Keep the memory a step frees for the next step instead of returning it to the kernel; None, else why not.

    glibc gives a freed block of more than its (adaptive) threshold back with
    ``munmap`` and trims the heap's top, so every step's activations are new
    pages: a 16 x 128 prefill of the default model took 128,700 page faults
    (0.43-0.47 s of system time each step, 2-core host). With every block up
    to :data:`HEAP_BLOCK_BYTES` from the heap and no trimming, the pages of one
    step serve the next (0 faults after the first); resident memory stays at
    the largest step's, as with a caching allocator. Process-wide, so set once.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:
        return f"the C library ({platform.libc_ver()[0] or 'unknown'}) has no mallopt"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCK_BYTES) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)):
        return "mallopt refused the thresholds"
    return None
