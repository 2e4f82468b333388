"""``cb``: entry point, common flags, and one clean line per error.

Each subcommand lives in ``cbcore/cli/<name>.py`` and exposes
``register(subparsers, common) -> None``, which adds its parser and sets
``func`` (``args -> int`` exit code).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
from typing import Any

from pydantic import ValidationError

COMMANDS = ("demo", "generate", "check", "bench", "serve", "profile", "simulate", "plugins")


class CLIError(Exception):
    """A user-facing failure: printed as one line (no traceback unless --log-level debug)."""


def common_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("common options")
    group.add_argument("--config", metavar="FILE", help="engine config (.yaml, .toml or .json)")
    group.add_argument(
        "--set",
        metavar="KEY.PATH=VALUE",
        action="append",
        default=[],
        dest="overrides",
        help="override one config value, e.g. --set scheduler.budget.max_num_seqs=4 (repeatable)",
    )
    group.add_argument(
        "--model", metavar="DIR_OR_ID", help="HF model directory or hub id (default: SmolLM2-135M)"
    )
    group.add_argument("--device", help="cpu, cuda, cuda:1 or auto (default: the config's, cpu)")
    group.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], help="model dtype")
    group.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"], help="log verbosity"
    )
    group.add_argument("--log-json", action="store_true", help="logs as JSON lines on stderr")
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cb", description="cbcore: continuous-batching inference with pluggable policies and backends"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"cbcore.cli.{name}")
        # A fresh parent per subcommand: argparse shares parent actions by
        # reference, so one subcommand overriding a flag must not change the others.
        module.register(sub, common_parser())
    return parser


def configure_logging(level: str = "warning", json_output: bool = False) -> None:
    """Send ``cbcore`` logs to stderr at ``level``, as text or one JSON object per line."""
    from cbcore import log

    log.json_output = json_output
    root = logging.getLogger("cbcore")
    root.setLevel(level.upper())
    root.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    fmt = "%(message)s" if json_output else "%(asctime)s %(levelname)-7s %(message)s"
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.propagate = False
    if level.lower() != "debug":
        # transformers reads this when it is imported; commands that never load a model never import it
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"
        if "transformers" in sys.modules:
            sys.modules["transformers"].logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_json)
    previous = opt_in_process_settings()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("cb: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.log_level == "debug":
            raise
        print(f"cb: error: {one_line(exc)}", file=sys.stderr)
        return 2
    finally:
        if previous is not None:  # a caller that runs main() in its own process keeps its own handler
            signal.signal(signal.SIGINT, previous)


def opt_in_process_settings() -> Any:
    """What the ``cb`` application sets for its whole process, which a library must not do for its host.

    glibc's allocator keeps the memory a step frees for the next step (no page
    faults per step: :func:`cbcore.kernels.heap.hold_freed_memory`), and a
    Ctrl-C is told apart from a policy raising KeyboardInterrupt
    (:data:`cbcore.scheduling.door.SIGNALLED`).
    """
    from cbcore.kernels.heap import hold_freed_memory
    from cbcore.log import get_logger
    from cbcore.scheduling.door import SIGNALLED

    why = hold_freed_memory()
    get_logger(__name__).info("freed memory", kept="yes" if why is None else "no", why=why)

    def on_ctrl_c(signum: int, frame: object) -> None:
        SIGNALLED.set()
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        return None  # only the main thread handles signals
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, on_ctrl_c)
    return previous  # the handler it replaced


def one_line(exc: BaseException) -> str:
    from cbcore.cli.config_files import format_validation_error

    if isinstance(exc, ValidationError):
        return format_validation_error(exc)
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, CLIError):
        return text.splitlines()[0]
    first = text.splitlines()[0]
    return (
        first
        if isinstance(exc, ValueError | OSError | RuntimeError | LookupError)
        else f"{type(exc).__name__}: {first}"
    )


if __name__ == "__main__":
    # `python -m cbcore.cli.main` (how `cb serve` is started by cbcore.serve.launch) runs this file as
    # __main__, a second copy of the module: the commands raise cbcore.cli.main's CLIError, so its main runs.
    from cbcore.cli import main as cli

    sys.exit(cli.main())
