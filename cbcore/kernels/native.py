"""cbcore's own C kernels: compiled on first use for this CPU, cached, loaded with ctypes.

A kernel is one C file beside this module (and the headers there, which it
may include). It is compiled with the machine's C compiler (``$CC``, else
``cc``) for this CPU (``-march=native``) and kept under cbcore's cache
directory, named by a hash of the sources, the flags, the compiler and the
CPU model, so a later process loads it in milliseconds and a
changed CPU or source builds anew.

Which vector instructions a build may use is its instruction set (:data:`ISAS`):
``avx512``, ``avx2`` or ``plain`` (the kernels' C loops, vectorised by the
compiler alone). The widest the CPU supports is not always the fastest (a
CPU may clock down under AVX-512, or run 512-bit work as two halves), so a
kernel that brings a trial (a representative call) is built for every
instruction set the CPU runs and timed once per machine, alternated, each
by its least time (other work only adds time); the widest is kept unless a
narrower one is :data:`MARGIN` faster. The choice is logged and kept in the
cache directory (``kernels/choices.json``), keyed
by the kernel's build identity (source, flags, compiler, CPU model), the
CPU's feature flags and torch's version, so a later process reads it instead
of timing again. A kernel without a trial is built for the widest.
``$CBCORE_KERNEL_ISA`` forces one instruction set for every kernel, so that
each path runs and is tested on one machine (an AVX-512 machine runs what an
AVX2-only CPU would). It is linked against the OpenMP runtime
torch has already loaded, so its threads are torch's threads. ctypes rather
than a torch extension: no torch headers, no pybind, a build of a fraction of
a second instead of a minute. Where no compiler is found or the build fails,
:meth:`NativeKernel.load` says why, and the caller decides what to run instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from cbcore.config import cache_root
from cbcore.log import get_logger

log = get_logger(__name__)

FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")
ISA_ENV = "CBCORE_KERNEL_ISA"
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
#: Instruction sets, widest first: the flags that narrow ``-march=native`` to it, and the CPU features
#: (``/proc/cpuinfo`` flags) it needs. ``plain`` builds everywhere.
ISAS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "avx512": ((), frozenset({"avx512f", "avx512dq", "avx2", "fma"})),
    "avx2": (("-mno-avx512f",), frozenset({"avx2", "fma"})),
    "plain": (("-mno-avx2", "-mno-avx512f") if _X86 else (), frozenset()),
}


#: How much faster (a share of the default's least time) another candidate of a :func:`timed_choice` (a
#: narrower instruction set, another library's product) must run its trial to be chosen: timings on a shared
#: machine drift by a few percent.
MARGIN = 0.03
#: Alternated rounds of each candidate's trial, and calls of the trial per round.
TRIAL_ROUNDS, TRIAL_CALLS = 9, 5
CHOICES_FILE = "choices.json"


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


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernel reports them (empty where there is no /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((x for x in text.splitlines() if x.startswith(("flags", "Features"))), "")
    return frozenset(line.split(":", 1)[-1].split())


def supported_isas() -> list[str]:
    """The instruction sets this CPU runs, widest first (``plain`` always)."""
    return [name for name, (_, needs) in ISAS.items() if needs <= cpu_flags() and (_X86 or not needs)]


def forced_isa() -> str | None:
    """The instruction set ``$CBCORE_KERNEL_ISA`` forces (None: the widest this CPU runs).

    A value that is not an instruction set, or one this CPU lacks, is an error (not a quiet fallback)."""
    value = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    if value == "auto":
        return None
    if value not in ISAS:
        raise ValueError(f"${ISA_ENV}={value!r}: expected auto or one of {', '.join(ISAS)}")
    if value not in supported_isas():
        raise ValueError(f"${ISA_ENV}={value}: this CPU lacks {', '.join(sorted(ISAS[value][1] - cpu_flags()))}")
    return value


def _compiler() -> str | None:
    explicit = os.environ.get("CC")
    if explicit:
        return shutil.which(explicit)
    return shutil.which("cc") or shutil.which("gcc")


def _library_path(source: Path, compiler: str, isa: str) -> Path:
    identity = "\n".join([compiler, " ".join((*FLAGS, *ISAS[isa][0])), hardware_name(), platform.machine()]).encode()
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what it may include
    digest = hashlib.sha256(source.read_bytes() + headers + b"\0" + identity).hexdigest()[:16]
    return cache_root() / "kernels" / f"{source.stem}-{isa}-{digest}.so"


def _build(source: Path, compiler: str, target: Path, isa: str) -> None:
    """Compile into a temporary file beside ``target``, then rename: concurrent builders never see half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{source.stem}.", suffix=".so")
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *FLAGS, *ISAS[isa][0], str(source), "-o", tmp, "-lm"], capture_output=True, text=True,
            timeout=300,
        )
        if result.returncode != 0:
            raise KernelUnavailable(
                f"{compiler} could not build {source.name} (exit {result.returncode}): "
                f"{result.stderr.strip()[-600:]}"
            )
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)


#: Variables that cap the instruction set of torch's oneDNN or MKL: a choice timed under one holds for it only.
LIBRARY_ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def machine_key() -> str:
    """What a timing measured here is valid for: the CPU model, its feature flags, torch's version and any
    cap on its libraries' instruction sets (:data:`LIBRARY_ISA_ENV`)."""
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    caps = "".join(f":{name}={os.environ[name]}" for name in LIBRARY_ISA_ENV if os.environ.get(name))
    return f"{hardware_name()}:{flags}:torch-{torch.__version__}{caps}"


def kept_choice(key: str, candidates: Iterable[str]) -> str | None:
    """The choice :func:`timed_choice` kept under ``key`` in the cache directory, if it is a candidate."""
    try:
        known = json.loads((cache_root() / "kernels" / CHOICES_FILE).read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return known["chosen"] if isinstance(known, dict) and known.get("chosen") in candidates else None


def timed_choice(key: str, runs: dict[str, Callable[[], object]], default: str, what: str, **context: object) -> str:
    """Which of ``runs`` (name: a representative call) to use on this machine: ``default`` unless another
    ran :data:`MARGIN` faster. Timed once, alternated (a warm-up turn, then :data:`TRIAL_ROUNDS` turns of
    :data:`TRIAL_CALLS` calls, each turn led by another), each by its least time (other work on the
    machine only ever adds to a call), logged and kept in the cache directory under ``key``, so that a
    later process reads it (:func:`kept_choice`) instead of timing again."""
    if (known := kept_choice(key, runs)) is not None:
        return known
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for turn in range(-1, TRIAL_ROUNDS):
        for name in order[turn % len(order) :] + order[: turn % len(order)]:
            for _ in range(TRIAL_CALLS):
                t0 = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - t0)
            del times[name][: TRIAL_CALLS if turn < 0 else 0]
    least = {name: min(t) for name, t in times.items()}
    best = min(least, key=least.__getitem__)
    chosen = best if least[best] < (1 - MARGIN) * least[default] else default
    path = cache_root() / "kernels" / CHOICES_FILE
    try:
        choices = json.loads(path.read_text())
    except (OSError, ValueError):
        choices = {}
    choices[key] = {"chosen": chosen, "least_us": {name: round(t * 1e6, 1) for name, t in least.items()}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".choices.", suffix=".json")
        with os.fdopen(fd, "w") as out:
            json.dump(choices, out, indent=1)
        os.replace(tmp, path)
    except OSError as exc:  # an unwritable cache: the choice holds for this process
        log.warning(f"{what} choice not kept", path=str(path), error=str(exc))
    log.info(f"{what} chosen by timing", chosen=chosen, cpu=hardware_name(), **context,
             **{f"{name}_us": round(t * 1e6, 1) for name, t in least.items()})  # fmt: skip
    return chosen


class NativeKernel:
    """One C function of one kernel file, built or loaded once per process on first use (a build is a
    subprocess, a load a dlopen)."""

    def __init__(
        self, source: Path, symbol: str, argtypes: list, trial: Callable[[], Callable[[], object]] | None = None
    ) -> None:
        """``trial``: makes a representative call's inputs once and returns the call (which runs
        :attr:`fn`), for timing the instruction sets against each other; None: build for the widest."""
        self.source, self.symbol, self.argtypes, self.trial = source, symbol, argtypes, trial
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
        return self._library(compiler, forced_isa() or self._chosen_isa(compiler))

    def _library(self, compiler: str, isa: str) -> tuple[ctypes._CFuncPtr | None, str]:
        """The function built for ``isa`` (built now, or loaded from the cache), or ``(None, why not)``."""
        target = _library_path(self.source, compiler, isa)
        origin = f"cached {target}"
        try:
            if not target.exists():
                try:
                    _build(self.source, compiler, target, isa)
                except OSError as exc:  # an unwritable cache: build where this process may write
                    log.warning("kernel cache not writable; building in a temporary directory", error=str(exc))
                    target = Path(tempfile.mkdtemp(prefix="cbcore-kernels-")) / target.name
                    _build(self.source, compiler, target, isa)
                origin = f"built {target}"
            fn = getattr(ctypes.CDLL(str(target)), self.symbol)
        except (KernelUnavailable, OSError, subprocess.SubprocessError, AttributeError) as exc:
            return None, str(exc)
        fn.argtypes, fn.restype = self.argtypes, ctypes.c_int
        log.debug("native kernel", symbol=self.symbol, isa=isa, origin=origin)
        return fn, origin

    def _chosen_isa(self, compiler: str) -> str:
        """The widest instruction set, unless this kernel's trial, timed once on this machine, ran a
        narrower one :data:`MARGIN` faster (:func:`timed_choice`)."""
        isas = supported_isas()
        if self.trial is None or len(isas) == 1:
            return isas[0]
        key = f"{_library_path(self.source, compiler, isas[0]).stem}:{self.symbol}:{machine_key()}"
        if (known := kept_choice(key, isas)) is not None:
            return known
        built = {isa: fn for isa in isas if (fn := self._library(compiler, isa)[0]) is not None}
        if len(built) < 2 or isas[0] not in built:
            return isas[0]  # nothing to compare: the widest, or its build error
        run = self.trial()

        def with_build(fn: ctypes._CFuncPtr) -> Callable[[], object]:
            def call() -> object:
                self.__dict__["fn"] = fn  # what the trial calls through self.fn
                return run()

            return call

        try:
            return timed_choice(key, {isa: with_build(fn) for isa, fn in built.items()}, isas[0],
                                "kernel instruction set", symbol=self.symbol)  # fmt: skip
        finally:
            self.__dict__.pop("fn", None)

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
        """Decide again on the next call (after a change of ``$CC``, ``$CBCORE_KERNEL_ISA`` or the cache directory)."""
        self._loaded = None
        self.__dict__.pop("fn", None)
