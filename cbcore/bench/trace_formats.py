"""Reading request traces: each known format detected by its columns, read into one shape.

| format | file | columns (others ignored) |
|---|---|---|
| ``azure`` | CSV | ``TIMESTAMP`` (date and time), ``ContextTokens``, ``GeneratedTokens`` (Azure LLM inference traces, 2023 and 2024) |
| ``mooncake`` | JSONL | ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (optional: 512-token prompt blocks) |
| ``vidur`` | CSV | ``num_prefill_tokens``, ``num_decode_tokens``, ``arrived_at`` (s; optional: a file without it holds lengths only) |
| ``cbcore`` | JSONL | cbcore's own records (``request_id``, ``arrival_s``, a prompt, ``max_new_tokens``; ``cb bench --save-trace``) |

Files may be gzip-compressed (recognised by their first bytes, whatever
their name). Every format becomes a :class:`TraceRows`: arrival offsets from
the first request, prompt and output lengths, and Mooncake's block hashes;
the rows keep the file's order, so a request's row number (its id) never
depends on the window a study takes.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from cbcore.bench.workload import (
    OLD_SPELLINGS,
    PROMPT_FIELDS,
    BenchRequest,
    WorkloadError,
    json_objects,
    parse_trace,
)

MOONCAKE_BLOCK_TOKENS = 512

#: Per format, the columns that identify it (all must be present) and a description for errors.
FORMATS: dict[str, tuple[frozenset[str], str]] = {
    "azure": (frozenset({"TIMESTAMP", "ContextTokens", "GeneratedTokens"}), "TIMESTAMP, ContextTokens, GeneratedTokens"),
    "mooncake": (frozenset({"timestamp", "input_length", "output_length"}),
                 "timestamp (ms), input_length, output_length[, hash_ids]"),
    "vidur": (frozenset({"num_prefill_tokens", "num_decode_tokens"}),
              "[arrived_at (s),] num_prefill_tokens, num_decode_tokens"),
    "cbcore": (frozenset({"arrival_s", "max_new_tokens"}), f"arrival_s, max_new_tokens, one of {', '.join(PROMPT_FIELDS)}"),
}  # fmt: skip


@dataclass
class TraceRows:
    """A trace as columns, in file order."""

    source: str
    format: str
    columns: list[str]
    times: np.ndarray | None  # float64 seconds after the first arrival; None: the file has none
    inputs: np.ndarray  # int64 prompt tokens (-1: a text prompt, length unknown without a tokenizer)
    outputs: np.ndarray  # int64 output tokens
    hash_ids: list[tuple[int, ...]] | None = None  # Mooncake's prompt blocks
    block_tokens: int | None = None
    records: list[BenchRequest] | None = None  # cbcore's own records

    def __len__(self) -> int:
        return len(self.inputs)


def read_trace(path: str | Path) -> TraceRows:
    """Read ``path`` in whichever known format its columns say; a clear error otherwise."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise WorkloadError(f"cannot read trace {path}: {exc.strerror}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise WorkloadError(f"trace {path}: a damaged gzip file ({exc})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"trace {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    first = next((line for line in text.splitlines() if line.strip()), None)
    if first is None:
        raise WorkloadError(f"trace {path}: the file is empty (it holds no requests)")
    if first.lstrip().startswith("{"):
        return _read_jsonl(str(path), text, first)
    return _read_csv(str(path), text)


def sniff_format(path: str | Path) -> str:
    """The format of ``path`` from its first record alone (no full read)."""
    path = Path(path)
    try:
        with path.open("rb") as raw:
            gz = raw.read(2) == b"\x1f\x8b"
        with gzip.open(path, "rt", encoding="utf-8-sig") if gz else path.open(encoding="utf-8-sig") as f:
            first = next((line for line in f if line.strip()), None)
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"cannot read trace {path}: {exc}") from None
    if first is None:
        raise WorkloadError(f"trace {path}: the file is empty (it holds no requests)")
    if first.lstrip().startswith("{"):
        try:
            columns = list(json.loads(first))
        except (json.JSONDecodeError, TypeError):
            columns = []
    else:
        columns = [h.strip() for h in next(csv.reader([first]))]
    return detect(columns, str(path))


def detect(columns: list[str], source: str) -> str:
    """The format whose identifying columns are all present; an error naming the columns found."""
    found = set(columns)
    for name, (needed, _) in FORMATS.items():
        if needed <= found:
            return name
    if found & set(PROMPT_FIELDS) or found & {"request_id", *OLD_SPELLINGS}:
        return "cbcore"
    expected = "; ".join(f"{name}: {desc}" for name, (_, desc) in FORMATS.items())
    shown = ", ".join(columns[:12]) + (", ..." if len(columns) > 12 else "")
    raise WorkloadError(f"trace {source}: columns {shown} match no known trace format (expected {expected})")


def _read_csv(source: str, text: str) -> TraceRows:
    reader = csv.reader(io.StringIO(text))
    header = [h.strip() for h in next(reader)]
    fmt = detect(header, source)
    if fmt not in ("azure", "vidur"):
        raise WorkloadError(f"trace {source}: a CSV file with the columns of a {fmt} trace, which is JSONL")
    if fmt == "azure":
        cols = {"time": "TIMESTAMP", "in": "ContextTokens", "out": "GeneratedTokens"}
    else:
        cols = {"time": "arrived_at", "in": "num_prefill_tokens", "out": "num_decode_tokens"}
    where = {key: header.index(name) for key, name in cols.items() if name in header}
    stamps: list[str] = []
    inputs: list[int] = []
    outputs: list[int] = []
    for number, row in enumerate(reader, start=2):
        if not row or not "".join(row).strip():
            continue
        if len(row) != len(header):
            raise WorkloadError(f"trace {source}:{number}: {len(row)} fields, the header names {len(header)}")
        inputs.append(_count(row[where["in"]], cols["in"], source, number))
        outputs.append(_count(row[where["out"]], cols["out"], source, number))
        if "time" in where:
            stamps.append(row[where["time"]])
    if not inputs:
        raise WorkloadError(f"trace {source}: the trace holds no requests")
    times = None
    if fmt == "azure":
        times = _datetimes(stamps, source)
    elif "time" in where:
        times = _seconds(stamps, cols["time"], source, scale=1.0)
    return TraceRows(source, fmt, header, times, np.array(inputs, np.int64), np.array(outputs, np.int64))


def _read_jsonl(source: str, text: str, first: str) -> TraceRows:
    try:
        columns = list(json.loads(first))
    except (json.JSONDecodeError, TypeError):
        columns = []
    fmt = detect(columns, source)
    if fmt == "cbcore":
        records = parse_trace(text.splitlines(), source)
        lengths = [r.num_prompt_tokens for r in records]
        return TraceRows(
            source, fmt, columns,
            times=np.array([r.arrival_s for r in records], np.float64),
            inputs=np.array([-1 if n is None else n for n in lengths], np.int64),
            outputs=np.array([r.max_new_tokens for r in records], np.int64),
            records=records,
        )  # fmt: skip
    if fmt != "mooncake":
        raise WorkloadError(f"trace {source}: a JSONL file with the columns of a {fmt} trace, which is CSV")
    stamps, inputs, outputs, hashes = [], [], [], []
    with_hashes = "hash_ids" in columns
    for number, data in json_objects(text.splitlines(), f"trace {source}"):
        missing = [c for c in ("timestamp", "input_length", "output_length") if c not in data]
        if missing:
            raise WorkloadError(f"trace {source}:{number}: no {missing[0]!r}")
        stamps.append(data["timestamp"])
        n_in = _count(data["input_length"], "input_length", source, number)
        inputs.append(n_in)
        outputs.append(_count(data["output_length"], "output_length", source, number))
        if with_hashes:
            hashes.append(_hashes(data.get("hash_ids"), n_in, source, number))
    times = _seconds(stamps, "timestamp", source, scale=1e-3)
    return TraceRows(
        source, fmt, columns, times, np.array(inputs, np.int64), np.array(outputs, np.int64),
        hash_ids=hashes if with_hashes else None, block_tokens=MOONCAKE_BLOCK_TOKENS if with_hashes else None,
    )  # fmt: skip


def _count(value: object, column: str, source: str, number: int) -> int:
    """A token count: a positive integer (``12`` or ``"12"``)."""
    try:
        n = int(value) if isinstance(value, int | str) and not isinstance(value, bool) else None
    except ValueError:
        n = None
    if n is None or n < 0:
        raise WorkloadError(f"trace {source}:{number}: {column} must be a non-negative integer, got {value!r}")
    return n


def _hashes(value: object, tokens: int, source: str, number: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(h) is int and h >= 0 for h in value):
        raise WorkloadError(f"trace {source}:{number}: hash_ids must be a list of non-negative integers")
    want = -(-tokens // MOONCAKE_BLOCK_TOKENS)
    if len(value) != want:
        raise WorkloadError(
            f"trace {source}:{number}: {len(value)} hash_ids for input_length {tokens} "
            f"(one per {MOONCAKE_BLOCK_TOKENS}-token block: expected {want})"
        )
    return tuple(value)


def _seconds(values: list[object], column: str, source: str, scale: float) -> np.ndarray:
    try:
        times = np.array([float(v) for v in values], np.float64) * scale  # type: ignore[arg-type]
    except (TypeError, ValueError):
        bad = next(v for v in values if not _is_number(v))
        raise WorkloadError(f"trace {source}: {column} must be a number, got {bad!r}") from None
    if not np.isfinite(times).all():
        raise WorkloadError(f"trace {source}: {column} holds a value that is not finite")
    return times - times.min()


def _is_number(value: object) -> bool:
    try:
        float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return True


def _datetimes(stamps: list[str], source: str) -> np.ndarray:
    parsed = []
    for number, stamp in enumerate(stamps, start=2):
        try:
            parsed.append(datetime.fromisoformat(stamp.strip()))
        except ValueError:
            raise WorkloadError(f"trace {source}:{number}: TIMESTAMP {stamp!r} is not a date and time") from None
    try:
        first = min(parsed)
        return np.array([(t - first).total_seconds() for t in parsed], np.float64)
    except TypeError:
        raise WorkloadError(f"trace {source}: TIMESTAMP mixes times with and without a time zone") from None
