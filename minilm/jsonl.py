"""The one reader and the one appender of the run's JSONL logs (metrics.jsonl, eval.jsonl)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .fsio import loads


def read_jsonl(path: str | os.PathLike, offset: int = 0, *, live: bool = False, record: Callable = lambda r: r,
               bad_line: Callable[[int], None] | None = None) -> tuple[list, int]:
    """The records of the lines of `path` after byte `offset`, and the offset after the last line read (with `live`, a
    last line without its newline is left for the next read). `record(value)` makes a line's JSON value the caller's
    record (None: left out); a line that is not JSON, or that `record` refuses, is passed over or goes to `bad_line`."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1 if live else len(data)
    records = []
    # Split at "\n" alone: str.splitlines() would also cut at a U+2028 inside a JSON string.
    for n, line in enumerate(data[:end].decode("utf-8", "replace").split("\n"), 1):
        try:
            value = record(loads(line)) if line.strip() else None
        except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: nesting past the stack
            value = bad_line(n) if bad_line else None
        if value is not None:
            records.append(value)
    return records, offset + end


def append_jsonl(path: str | os.PathLike, records: Iterable[Any], **dumps: Any) -> None:
    """One line per record (`dumps`: json.dumps' options); a killed writer's torn last line is ended first."""
    text = "".join(json.dumps(r, **dumps) + "\n" for r in records).encode()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        if f.tell():
            f.seek(-1, os.SEEK_END)
            text = text if f.read(1) == b"\n" else b"\n" + text
        f.write(text)
