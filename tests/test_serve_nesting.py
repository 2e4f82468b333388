"""The JSON depth check of `cb serve` (cbcore/serve/nesting.py), on bodies given as bytes.

* The depth it measures equals the value's own depth on random JSON, strings
  full of brackets, quotes and escapes included.
* A body one level past the limit is refused with the path of the container
  that passes it; one at the limit is not; a 100,000-deep body is refused
  from its first 64 levels.
* Bodies that are not JSON are left to the parser (no answer, no error).
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from cbcore.serve.nesting import MAX_JSON_DEPTH, max_depth, may_nest_deeper, too_deep

BRACKETY = st.text(alphabet='[]{}"\\:, ab\u00e9\n', max_size=12)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | BRACKETY,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(BRACKETY, inner, max_size=4),
    max_leaves=40,
)


def depth_of(value: object) -> int:
    """The value's nesting: a container is one level more than its deepest item."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


@settings(max_examples=300, deadline=None)
@given(JSON, st.booleans())
def test_the_measured_depth_is_the_values_own(value, ascii_only):
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert max_depth(body) == depth_of(value)
    if not may_nest_deeper(body, 2):
        assert depth_of(value) <= 2


def body_with_attrs(levels: int) -> bytes:
    """A completion body whose ``attrs`` are ``levels`` objects deep (the body is one more)."""
    return b'{"model": "m", "prompt": "[{", "attrs": ' + b'{"a": ' * levels + b"1" + b"}" * levels + b"}"


def test_one_level_past_the_limit_is_refused_with_its_path():
    assert too_deep(body_with_attrs(MAX_JSON_DEPTH - 1)) is None
    field, path = too_deep(body_with_attrs(MAX_JSON_DEPTH))
    assert field == "attrs" and path == "attrs" + ".a" * (MAX_JSON_DEPTH - 1)
    field, path = too_deep(body_with_attrs(100_000))
    assert field == "attrs" and path == "attrs" + ".a" * (MAX_JSON_DEPTH - 1)


def test_paths_name_keys_and_indices_and_skip_strings():
    inner: list = []
    for _ in range(MAX_JSON_DEPTH):
        inner = [inner]
    value = {"a]": "}}", 'k"{': [0, "[", {"m": [1, inner]}]}
    field, path = too_deep(json.dumps(value).encode())
    assert field == 'k"{'
    assert path == 'k"{[2].m[1]' + "[0]" * (MAX_JSON_DEPTH - 4)
    field, path = too_deep(b"[" * 200 + b"]" * 200)  # an array at the top names no field
    assert field == "" and path == "[0]" * MAX_JSON_DEPTH
    long_key = "k" * 300
    field, path = too_deep(json.dumps({long_key: [[[[]]]] * 40}).encode(), limit=3)
    assert field == long_key and path == long_key[:200] + "..."


def test_bodies_that_are_not_json_are_left_to_the_parser():
    assert too_deep(b"]" + b"[" * 100) is None  # a close before any open
    assert too_deep(b'{"' + b"[" * 100) is None  # an unterminated string holds the rest
    assert too_deep(b"[" * 10) is None  # few brackets: not even measured
    assert too_deep(b'{"a": "\\' + b"[" * 100) is None  # ... also when it ends in an escape
    assert too_deep(b"{" + b"[" * 100) is None  # a container where a key belongs
