"""The inputs of `ray_jobs.prepare`: which files, and every record in them, checked, in input order. pyarrow and
datasets load only when a parquet or datasets input is read."""

from __future__ import annotations

import glob
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from minilm.errors import UsageError  # the one usage-error class: `error: ...`, exit 2

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".txt": "txt", ".parquet": "parquet"}
MAX_SKIP_WARNINGS = 10

@dataclass
class Source:
    path: Path
    display: str  # the path as the user would recognise it (given, globbed or walked)
    kind: str  # jsonl | txt | parquet | hf
    bytes: int


SUPPORTED = "inputs are .jsonl, .txt, .parquet and datasets save_to_disk folders"


def _is_hf_dict(p: Path) -> bool:
    return (p / "dataset_dict.json").is_file()


class _Inputs:
    """The sources found so far (each once) and the files ignored, per input spec."""

    def __init__(self, exclude: Path | None, warn: Callable[[str], None]):
        self.sources: list[Source] = []
        self.seen: dict[Path, str] = {}  # the inputs and the folders walked, resolved
        self.ignored: dict[str, list[str]] = {}
        self.warn = warn
        self.exclude = exclude.resolve() if exclude is not None else None
        # The output folder and its temporary siblings are never inputs.
        self.exclude_re = re.compile(re.escape(self.exclude.name) + r"(\.(tmp|old)-\d+)?") if exclude else None

    def excluded(self, p: Path) -> bool:
        return self.exclude_re is not None and p.resolve().parent == self.exclude.parent and bool(
            self.exclude_re.fullmatch(p.name))

    def add(self, p: Path, display: str, kind: str) -> None:
        key = p.resolve()
        if key in self.seen:
            self.warn(f"{display} is the same input as {self.seen[key]}; reading it once")
            return
        self.seen[key] = display
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if kind == "hf" else p.stat().st_size
        self.sources.append(Source(path=p, display=display, kind=kind, bytes=size))

    def walk(self, d: Path, display: str, top: str) -> None:
        if d.resolve() in self.seen:  # a symlink loop, or a folder reached twice
            return
        self.seen[d.resolve()] = display
        for child in sorted(d.iterdir(), key=lambda c: c.name):
            shown = os.path.join(display, child.name)
            if child.name.startswith(".") or self.excluded(child):
                continue
            if child.is_dir() and _is_hf_dict(child):  # named, not refused, inside a folder
                self.ignored.setdefault(top, []).append(shown + "/ (a DatasetDict)")
            else:
                self.add_path(shown, explicit=False, top=top)  # `shown` is the child's path

    def add_path(self, spec_path: str, explicit: bool, top: str) -> None:
        p = Path(spec_path)
        if p.is_dir():
            if (p / "dataset_info.json").is_file() and (p / "state.json").is_file():  # a datasets Dataset
                self.add(p, spec_path, "hf")
            elif _is_hf_dict(p):
                splits = ""
                try:
                    splits = ", ".join(json.loads((p / "dataset_dict.json").read_text()).get("splits", []))
                except (OSError, ValueError, AttributeError):
                    pass
                raise UsageError(f"input {spec_path} is a datasets DatasetDict (splits: {splits or '?'}); "
                                 f"pass one split's folder, e.g. {os.path.join(spec_path, 'train')}")
            else:
                self.walk(p, spec_path, top)
        elif p.is_file():
            kind = FORMATS.get(p.suffix.lower())
            if kind:
                self.add(p, spec_path, kind)
            elif explicit:
                raise UsageError(f"input {spec_path}: unsupported file type {p.suffix or '(no suffix)'!r}; use "
                                 f".jsonl, .txt, .parquet or a datasets save_to_disk folder")
            else:
                self.ignored.setdefault(top, []).append(spec_path)
        elif explicit:
            raise UsageError(f"input {spec_path} does not exist")


def resolve_inputs(specs: list[str], exclude: Path | None = None,
                   warn: Callable[[str], None] = lambda m: None) -> list[Source]:
    """Expand globs and directories (sorted) into the ordered list of sources; refuse what is unusable."""
    found = _Inputs(exclude, warn)
    for spec in specs:
        if glob.has_magic(spec):
            matches = sorted(m for m in glob.glob(spec, recursive=True) if not found.excluded(Path(m)))
            if not matches:
                raise UsageError(f"input {spec}: no file matches this pattern")
            for m in matches:
                found.add_path(m, explicit=False, top=spec)
        else:
            found.add_path(spec, explicit=True, top=spec)
    for top, names in found.ignored.items():
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        warn(f"ignoring {len(names)} file(s) of unsupported type in {top}: {', '.join(names[:3])}{more} ({SUPPORTED})")
    if not found.sources:
        raise UsageError("no input files found in " + " ".join(specs) + f" ({SUPPORTED})")
    return found.sources


@dataclass
class Bad:
    reason: str
    detail: str


def _utf8_detail(raw: bytes, e: UnicodeDecodeError) -> tuple[int, str]:
    """(line number, detail) of the first invalid byte in `raw`."""
    line = raw.count(b"\n", 0, e.start) + 1
    col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
    return line, f"invalid UTF-8 (byte 0x{raw[e.start]:02x} at column {col})"


def _check_text(value, field_name: str) -> str | Bad:
    if not isinstance(value, str):
        what = "null" if value is None else type(value).__name__
        return Bad("non_string_text", f"{field_name!r} is {what}, not a string")
    if value == "":
        return Bad("empty_text", f"{field_name!r} is empty")
    return value


def _read_jsonl(src: Source, text_field: str) -> Iterator[tuple[str, str | Bad, float]]:
    with open(src.path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            raw = raw.removeprefix(b"\xef\xbb\xbf") if lineno == 1 else raw
            if raw.strip():
                yield f"{src.display}:{lineno}", _jsonl_record(raw.rstrip(b"\r\n"), text_field), len(raw)


def _jsonl_record(line: bytes, text_field: str) -> str | Bad:
    try:
        obj = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        return Bad("invalid_utf8", _utf8_detail(line, e)[1])
    except json.JSONDecodeError as e:
        return Bad("malformed_json", f"malformed JSON ({e.msg} at column {e.colno})")
    except (ValueError, RecursionError) as e:  # an integer of > 4300 digits; nesting deeper than the stack
        return Bad("malformed_json", f"JSON that Python refuses to read ({str(e).split(':')[0]})")
    if not isinstance(obj, dict):
        return Bad("not_an_object", f"a JSON {type(obj).__name__}, not an object with {text_field!r}")
    if text_field not in obj:
        keys = ", ".join(repr(k)[1:-1][:40] for k in list(obj)[:5]) or "none"  # escaped: one short line
        return Bad("missing_text_field", f"no {text_field!r} field (keys: {keys})")
    return _check_text(obj[text_field], text_field)


def _read_txt(src: Source, text_field: str) -> Iterator[tuple[str, str | Bad, float]]:
    raw = src.path.read_bytes().removeprefix(b"\xef\xbb\xbf")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line, detail = _utf8_detail(raw, e)
        yield f"{src.display}:{line}", Bad("invalid_utf8", detail), len(raw)
        return
    if text.strip():
        yield f"{src.display}:1", text, len(raw)


def _read_columnar(src: Source, text_field: str, schema, num_rows: int,
                   batches: Callable[[], Iterator]) -> Iterator[tuple[str, str | Bad, float]]:
    """The rows of `schema`'s column `text_field`, read from `batches()` (tables or record batches)."""
    import pyarrow as pa

    share = src.bytes / max(1, num_rows)  # each row's share of the input's size, for the progress bar
    names = schema.names
    col_type = schema.field(text_field).type if text_field in names else None
    if col_type is None:
        bad = Bad("missing_text_field", f"no {text_field!r} column (columns: {', '.join(names[:8]) or 'none'})")
    elif str(col_type) not in ("string", "large_string", "binary", "large_binary", "string_view", "binary_view"):
        bad = Bad("non_string_text", f"column {text_field!r} has type {col_type}, not string")
    else:
        bad = None
    if bad is not None:  # every row is bad alike: the column is not read
        for row in range(1, num_rows + 1):
            yield f"{src.display}: row {row}", bad, share
        return
    row = 0
    for batch in batches():
        for value in batch.column(text_field).cast(pa.large_binary()).to_pylist():
            row += 1
            try:
                rec = _check_text(value if value is None else value.decode("utf-8"), text_field)
            except UnicodeDecodeError as e:
                rec = Bad("invalid_utf8", _utf8_detail(value, e)[1])
            yield f"{src.display}: row {row}", rec, share


def _read_parquet(src: Source, text_field: str) -> Iterator[tuple[str, str | Bad, float]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(src.path)
        schema = pf.schema_arrow
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a file that is not parquet
        raise UsageError(f"{src.display}: not a readable parquet file ({e})") from None
    try:
        yield from _read_columnar(src, text_field, schema, pf.metadata.num_rows,
                                  lambda: pf.iter_batches(batch_size=8192, columns=[text_field]))
    except OSError as e:
        raise UsageError(f"{src.display}: cannot read parquet data ({e})") from None


def _read_hf(src: Source, text_field: str) -> Iterator[tuple[str, str | Bad, float]]:
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_from_disk(str(src.path))
    except Exception as e:  # datasets raises FileNotFoundError / various for a damaged folder
        raise UsageError(f"{src.display}: cannot load the datasets folder ({type(e).__name__}: {e})") from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    if not isinstance(ds, datasets.Dataset):
        raise UsageError(f"{src.display}: is a {type(ds).__name__}, not a single Dataset; pass one split's folder")
    yield from _read_columnar(src, text_field, ds.data.schema, ds.num_rows,
                              lambda: ds.with_format("arrow").iter(batch_size=8192))


# Each reader yields (where, text or Bad, input bytes the record took) for every record of one input.
READERS = {"jsonl": _read_jsonl, "txt": _read_txt, "parquet": _read_parquet, "hf": _read_hf}


class SkipWarnings:
    """Prints the first few skipped records (each once, though the tokenizer pass reads them too)."""

    def __init__(self, warn: Callable[[str], None]):
        self.warn = warn
        self.shown: set[str] = set()

    def __call__(self, where: str, detail: str) -> None:
        if where in self.shown or len(self.shown) >= MAX_SKIP_WARNINGS:
            return
        self.shown.add(where)
        self.warn(f"skipping {where}: {detail}" + (f" (showing the first {MAX_SKIP_WARNINGS} skips; the manifest "
                                                   f"counts them all)" if len(self.shown) == MAX_SKIP_WARNINGS else ""))


class RecordReader:
    """Yields (text, utf8_bytes) of every usable record, in input order, counting what it skips; in `error` mode
    the first bad record (an empty text never is) raises UsageError naming file:line."""

    def __init__(self, sources: list[Source], text_field: str, on_bad: str,
                 warn: Callable[[str, str], None] = lambda where, detail: None):
        self.sources = sources
        self.text_field = text_field
        self.on_bad = on_bad
        self.warn = warn
        self.skipped: Counter[str] = Counter()
        self.examples: list[str] = []
        self.empty_inputs: list[str] = []
        self.documents = 0
        self.text_bytes = 0
        self.input_bytes = 0.0  # of the input files, read so far (what the progress bar counts)
        self.per_source = [{"documents": 0, "skipped": 0} for _ in sources]
        self._current = 0

    def _skip(self, where: str, bad: Bad) -> None:
        if self.on_bad == "error" and bad.reason != "empty_text":
            raise UsageError(f"{where}: {bad.detail}",
                            hint="pass --on-bad-record skip to skip bad records (they are counted in the manifest)")
        self.skipped[bad.reason] += 1
        self.per_source[self._current]["skipped"] += 1
        if len(self.examples) < 100:
            self.examples.append(f"{where}: {bad.detail}")
        self.warn(where, bad.detail)

    def __iter__(self) -> Iterator[tuple[str, int]]:
        for i, src in enumerate(self.sources):
            self._current = i
            done_before = self.input_bytes
            for where, rec, raw_bytes in self._read(src):
                self.input_bytes += raw_bytes
                if isinstance(rec, Bad):
                    self._skip(where, rec)
                    continue
                try:
                    nbytes = len(rec.encode("utf-8"))
                except UnicodeEncodeError as e:  # a lone surrogate, from a \ud800 escape in JSON
                    self._skip(where, Bad("invalid_utf8", f"{self.text_field!r} holds a lone surrogate "
                                                        f"{rec[e.start]!r}: not valid Unicode"))
                    continue
                self.per_source[i]["documents"] += 1
                self.documents += 1
                self.text_bytes += nbytes
                yield rec, nbytes
            self.input_bytes = done_before + src.bytes
            if not any(self.per_source[i].values()):  # no record, usable or skipped
                if self.on_bad == "error":
                    raise UsageError(f"{src.display}: the input is empty (no records)",
                                    hint="remove it, or pass --on-bad-record skip to skip empty inputs")
                self.empty_inputs.append(src.display)
                self.warn(src.display, "the input is empty (no records)")

    def _read(self, src: Source) -> Iterator[tuple[str, str | Bad, float]]:
        try:
            yield from READERS[src.kind](src, self.text_field)
        except OSError as e:
            raise UsageError(f"{src.display}: cannot read it ({e.strerror or e})") from None

    @property
    def documents_skipped(self) -> int:
        return sum(self.skipped.values())
