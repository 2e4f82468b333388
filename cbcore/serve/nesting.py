"""How deep a JSON body nests, read from its bytes before anything parses it.

Python's JSON parser, pydantic and whatever later walks a value (freezing
``attrs``, a chat template) all recurse, one stack frame or more per level,
so a small body nested a thousand deep can exhaust the stack: a 500 and a
traceback per request. A body nested deeper than :data:`MAX_JSON_DEPTH` is
refused here instead, naming the path where it passes the limit.

Most bodies cost a byte count: one with no more than the limit of ``[`` and
``{`` together cannot nest deeper than it. Past that, the depth is measured
without a Python loop (strings emptied by a regular expression, everything
but brackets deleted, a running sum in numpy: about 10 ms a megabyte), and
only a body found too deep is walked token by token (strings whole, so a
bracket inside one does not count; brackets, colons, commas) to name the
path. This is not a parser: anything else is left to the JSON parser that
runs after it.
"""

from __future__ import annotations

import json
import re

import numpy as np

#: The deepest nesting a request body may have; the body itself is the first level.
MAX_JSON_DEPTH = 64
# A string, escapes included ("a\"]" is one); one left open runs to the end of the body.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_TOKEN = re.compile(_STRING.pattern + rb"|[\[\]{}:,]", re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SHOWN_PATH_CHARS = 200


def may_nest_deeper(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """False when ``body`` cannot nest deeper than ``limit``: it opens no more containers than that."""
    return body.count(b"[") + body.count(b"{") > limit


def max_depth(body: bytes) -> int:
    """The deepest nesting of brackets outside strings in ``body`` (0 for none)."""
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    opens = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((opens == ord("[")) | (opens == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max())


def too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> tuple[str, str] | None:
    """``(field, path)`` of the first container deeper than ``limit`` in a JSON body, else None.

    ``field`` is the top-level key it sits under ("" when the body is an array or the
    path starts at the top); ``path`` its place, as ``attrs.a.b[0]...`` (cut past 200 characters).
    A body that is not well-formed JSON is left to the parser: the scan stops at the first close
    without an open and answers None.
    """
    if not may_nest_deeper(body, limit) or max_depth(body) <= limit:
        return None
    # One frame per open container: [is an object, its current key or index, a key comes next].
    frames: list[list[object]] = []
    for match in _TOKEN.finditer(body):
        token = match.group()
        first = token[:1]
        if first in (b"{", b"["):
            if frames and frames[-1][0] and frames[-1][2]:
                return None  # a container where an object's key belongs: not JSON
            if len(frames) == limit:
                return _place(frames)
            frames.append([True, None, True] if first == b"{" else [False, 0, False])
        elif first in (b"}", b"]"):
            if not frames:
                return None
            frames.pop()
        elif not frames:
            continue
        elif first == b",":
            top = frames[-1]
            if top[0]:
                top[2] = True
            else:
                top[1] = int(top[1]) + 1  # type: ignore[call-overload]
        elif first == b":":
            frames[-1][2] = False
        elif frames[-1][0] and frames[-1][2]:  # an object's key
            try:
                frames[-1][1] = json.loads(token)
            except ValueError:
                return None
    return None


def _place(frames: list[list[object]]) -> tuple[str, str]:
    parts = [f".{key}" if is_object else f"[{key}]" for is_object, key, _ in frames]
    path = "".join(parts).removeprefix(".")
    field = str(frames[0][1]) if frames and frames[0][0] else ""
    if len(path) > _SHOWN_PATH_CHARS:
        path = path[:_SHOWN_PATH_CHARS] + "..."
    return field, path
