"""`cb plugins`: every registered policy and backend, where it came from, and its parameters.

What is listed is exactly what a config can name: the registry built-ins,
installed entry points and the config's ``plugins:`` modules all go through.
``--markdown`` prints the parameter reference that docs/policies.md embeds,
generated from the ``Params`` models so the documentation cannot drift.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from cbcore.cli.main import CLIError
from cbcore.plugins import KINDS, Registered, Registry

KIND_ORDER = {kind: i for i, kind in enumerate(KINDS)}


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = sub.add_parser(
        "plugins",
        parents=[common],
        help="list registered policies and backends",
        description="List every registered policy and backend with its kind, origin and parameters.",
    )
    fmt = parser.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="machine-readable output")
    fmt.add_argument(
        "--markdown",
        action="store_true",
        help="the built-in policies' parameter reference (docs/policies.md)",
    )
    parser.add_argument("--kind", choices=KINDS, help="only this kind")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    registry = _registry(args)
    entries = sorted(registry.entries(args.kind), key=lambda e: (KIND_ORDER[e.kind], e.name))
    if args.markdown:
        print(
            markdown_reference(e for e in entries if e.origin == "built-in" and e.kind != "backend"), end=""
        )
        return 0
    devices = _devices(args.device)
    rows = [describe(e, devices) for e in entries]
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        print(table(rows), end="")
    for name, why in registry.broken:  # skipped, so that the others still work; said, never silent
        print(f"warning: entry point {name} failed to load and was skipped: {why}", file=sys.stderr)
    return 0


def _registry(args: argparse.Namespace) -> Registry:
    """The registry for the config's ``plugins:`` list (the rest of the config is not needed here)."""
    from cbcore.cli.common import config_data
    from cbcore.cli.config_files import apply_overrides
    from cbcore.plugins import get_registry

    data = apply_overrides(config_data(args), args.overrides)
    plugins = data.get("plugins") or []
    if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
        raise CLIError(f"plugins: expected a list of module names or .py paths, got {plugins!r}")
    return get_registry(tuple(plugins))


def _devices(requested: str | None) -> list[str]:
    import torch

    if requested and requested != "auto":
        try:
            torch.device(requested)
        except RuntimeError as exc:
            raise CLIError(f"--device {requested!r} is not a device torch knows: {exc}") from None
        return [requested]
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


# -- describing one plugin -----------------------------------------------------


def parameters(model: type[BaseModel]) -> list[dict[str, Any]]:
    """Name, type, default and description of every field of a ``Params`` model."""
    params = []
    for name, field in model.model_fields.items():
        if field.default_factory is not None:
            default: Any = field.default_factory()  # type: ignore[call-arg]
        elif field.default is PydanticUndefined:
            default = "(required)"
        else:
            default = field.default
        params.append(
            {
                "name": name,
                "type": _type_name(field.annotation),
                "default": default,
                "description": field.description or "",
            }
        )
    return params


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    return text or str(annotation).replace("typing.", "")


def describe(entry: Registered, devices: list[str]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "kind": entry.kind,
        "name": entry.name,
        "origin": entry.origin,
        "class": f"{entry.cls.__module__}.{entry.cls.__qualname__}",
        "summary": _summary(entry.cls),
        "params": parameters(entry.cls.Params),
    }
    if entry.kind == "backend":
        import torch

        reasons = {d: _device_missing(d) or entry.cls.unavailable_reason(torch.device(d)) for d in devices}
        row["available"] = {d: reason is None for d, reason in reasons.items()}
        row["unavailable_reason"] = {d: reason for d, reason in reasons.items() if reason is not None}
    return row


def _device_missing(device: str) -> str | None:
    import torch

    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        return "this machine has no usable CUDA device"
    return None


def _summary(cls: type) -> str:
    doc = (cls.__doc__ or "").strip()
    return doc.split("\n\n")[0].replace("\n", " ").strip()


def _fmt(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str | dict | list) else repr(value)


# -- output ------------------------------------------------------------------------


def table(rows: list[dict[str, Any]]) -> str:
    """One line per plugin, then one indented line per parameter."""
    if not rows:
        return "no plugins registered\n"
    name_w = max(len(r["name"]) for r in rows)
    kind_w = max(len(r["kind"]) for r in rows)
    origin_w = max(len(r["origin"]) for r in rows)
    lines = [f"{'KIND':<{kind_w}}  {'NAME':<{name_w}}  {'ORIGIN':<{origin_w}}  STATUS / PARAMETERS"]
    for r in rows:
        status = ""
        if r["kind"] == "backend":
            status = "; ".join(
                f"{dev}: available" if ok else f"{dev}: unavailable ({r['unavailable_reason'][dev]})"
                for dev, ok in r["available"].items()
            )
        lines.append(
            f"{r['kind']:<{kind_w}}  {r['name']:<{name_w}}  {r['origin']:<{origin_w}}  {status}".rstrip()
        )
        indent = " " * (kind_w + 2)
        for p in r["params"]:
            desc = f"  {p['description']}" if p["description"] else ""
            lines.append(f"{indent}  {p['name']}: {p['type']} = {_fmt(p['default'])}{desc}")
    return "\n".join(lines) + "\n"


def markdown_reference(entries: Any) -> str:
    """A section per policy: its summary and a parameter table (generated, never hand-edited)."""
    out: list[str] = []
    for entry in entries:
        out.append(f"### `{entry.name}` ({entry.kind})\n")
        summary = _summary(entry.cls).replace("``", "`")
        if summary:
            out.append(f"{summary}\n")
        params = parameters(entry.cls.Params)
        if params:
            out.append("| parameter | type | default | meaning |")
            out.append("|---|---|---|---|")
            for p in params:
                desc = p["description"].replace("|", "\\|")
                kind = p["type"].replace("|", "\\|")
                out.append(f"| `{p['name']}` | `{kind}` | `{_fmt(p['default'])}` | {desc} |")
            out.append("")
        else:
            out.append("No parameters.\n")
    return "\n".join(out) + "\n"
