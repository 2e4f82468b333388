"""The rows of `cb bench` and `cb simulate`: one per --config x --policy x --backend, each with its own policy
parameters, and the workload checks (--replicates, --capacity) made before anything loads."""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from cbcore.cli.config_files import format_validation_error
from cbcore.cli.main import CLIError


def check_replicates(args: argparse.Namespace) -> Any:
    """``--replicates`` and ``--capacity`` against the workload, before anything loads.

    Returns the SLO the suite scores (``--slo``, or the attainment objective's).
    """
    from cbcore.bench.metrics import SLO
    from cbcore.bench.replicates import replicate_specs

    if args.replicates > 1 and args.save_trace:
        raise CLIError("--save-trace with --replicates: each replicate draws another workload; save one at a time")
    replicate_specs(args.workload, args.replicates)
    slo = SLO.parse(args.slo) if args.slo else None
    if not args.capacity:
        return slo
    from cbcore.bench.capacity import Objective, rate_spec
    from cbcore.bench.replicates import _is_file

    objectives = [Objective.parse(text) for text in args.capacity]
    if args.sweep or args.save_trace:
        raise CLIError("--capacity varies rate= itself: it takes no --sweep or --save-trace")
    if _is_file(args.workload.strip()):
        raise CLIError(f"--capacity needs a workload with a rate= key (a generator or a trace spec), got {args.workload!r}")
    rate_spec(args.workload, 1.0)
    wanted = {o.slo() for o in objectives} - {None}
    if len(wanted) > 1 or (wanted and slo is not None and wanted != {slo}):
        raise CLIError("--capacity: the attainment objectives and --slo must name the same TTFT and TPOT")
    return wanted.pop() if wanted else slo


def row_label(given: str | None) -> tuple[str | None, str | None]:
    """``NAME=MIX`` -> (NAME, MIX); a bare mix names its own row; ``@FILE`` rows are named by the file."""
    if given is None:
        return None, None
    head, eq, rest = given.partition("=")
    if eq and head.strip() and all(c.isalnum() or c in "_.-" for c in head.strip()):
        return head.strip(), rest.strip()
    if given.startswith("@"):
        return Path(given[1:]).stem, given
    return given, given


def row_scheduler(mix: str, plugins: tuple[str, ...]) -> dict[str, Any]:
    """A row's scheduler section: from a policy mix, or ``@FILE`` (a config file's scheduler section)."""
    from cbcore.cli.common import scheduler_from_mix
    from cbcore.cli.config_files import read_config_file

    if not mix.startswith("@"):
        return scheduler_from_mix(mix, plugins)
    data = read_config_file(mix[1:])
    section = data.get("scheduler", data) if isinstance(data, dict) else data
    if not isinstance(section, dict):
        raise CLIError(f"--policy {mix}: the file holds no scheduler section")
    return section


def row_refusal(name: str, scheduler: dict[str, Any] | None, exc: Exception) -> str:
    """A refused row's configuration, naming the row and (where the error is in one slot) its policy."""
    from cbcore.cli.main import one_line

    text = one_line(exc) if not isinstance(exc, ValidationError) else format_validation_error(exc)
    for slot in ("queue", "budget", "prefill", "preemption"):
        if f"scheduler.{slot}" in text:
            policy = ((scheduler or {}).get(slot) or {}).get("name") or "the config's or default"
            return f"row {name!r}: {slot} policy {policy!r}: {text}"
    return f"row {name!r}: {text}"


def build_configs(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """One (row name, Settings) per combination of --config, --policy and --backend."""
    from cbcore.cli.common import config_data, engine_config
    from cbcore.config import ConfigError
    from cbcore.plugins import PluginError

    rows = []
    for path in args.configs or [None]:
        ns = copy.copy(args)
        ns.config = path
        plugins = tuple(config_data(ns).get("plugins") or ())
        for given in args.policies or [None]:
            label, mix = row_label(given)
            for backend in args.backends or [None]:
                extra: dict[str, Any] = {}
                if mix is not None:
                    extra["scheduler"] = row_scheduler(mix, plugins)
                if backend is not None:
                    extra["backend"] = {"name": backend}
                parts = [Path(path).stem if path else None, label, backend]
                name = "/".join(p for p in parts if p) or "default"
                try:
                    rows.append((name, engine_config(ns, extra, getattr(args, "runs_model", True))))
                except (ValueError, ConfigError, PluginError) as exc:
                    raise CLIError(row_refusal(name, extra.get("scheduler"), exc)) from None
    if (len(args.configs) > 1 and args.policies) or (args.configs and len(args.policies) > 1):
        print(
            f"cb: note: {len(args.configs)} --config x {len(args.policies)} --policy = {len(rows)} rows "
            "(each --policy replaces the scheduler section of each config)",
            file=sys.stderr,
        )
    models = {c.model.model_dump_json() for _, c in rows}
    if len(models) > 1:
        raise CLIError("all configurations must use the same model section (one model serves every row)")
    return rows
