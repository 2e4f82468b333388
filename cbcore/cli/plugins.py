"""`cb plugins` (placeholder until its issue lands: exits with an error)."""

from __future__ import annotations

import argparse

from cbcore.cli.main import CLIError


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = sub.add_parser("plugins", parents=[common], help="not implemented yet")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise CLIError("cb plugins is not implemented yet")
