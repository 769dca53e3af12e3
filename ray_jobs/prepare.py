"""Tokenize and pack a corpus into the prepared-data format of docs/data.md.

    python -m ray_jobs.prepare --input corpus/*.jsonl --output data/tok
    python -m ray_jobs.prepare --input books/ wiki.parquet --output data/tok --tokenizer tokenizer.json
    python -m ray_jobs.prepare --input corpus.jsonl --output data/tok --seq-len 512 --vocab-size 6400

Inputs, read in the order given (a directory is walked recursively, a glob is expanded, both sorted):

* `.jsonl` / `.ndjson`: one JSON object per line, text in `--text-field` (MiniMind's `{"text": ...}`);
  blank lines are ignored;
* `.txt`: the whole file is one document;
* `.parquet`: one document per row of the `--text-field` column;
* a folder written by `datasets.Dataset.save_to_disk` (it holds dataset_info.json and state.json).

The driver reads and checks every record, so a bad one is reported as `file:line` (parquet and
datasets: `file: row N`) and stops the run; with `--on-bad-record skip` it is skipped, counted by
reason in the manifest (`skipped_by_reason`: malformed_json, not_an_object, missing_text_field,
non_string_text, invalid_utf8) and the first few are shown as warnings. An empty text (`""`) is
always skipped and counted as `empty_text`, never an error; an input with no record at all is an
error, or with `skip` listed in the manifest's `empty_inputs`. `documents_read` counts the documents
packed, `documents_skipped` the records skipped.

Without `--tokenizer`, a byte-level BPE of `--vocab-size` tokens is trained on the first 8 MB of
usable text (in input order) before tokenizing. Records go to Ray in blocks
(`ray.data.from_arrow_refs`); `map_batches` encodes each block with the tokenizer's batched
`encode_batch_fast` in Ray tasks; blocks come back in input order (preserve_order, and checked), are
packed into rows of seq_len + 1 and written as shards. The same inputs and options give the same
shard bytes and fingerprint. The output folder appears only when complete (see minilm.packing).

Exit status: 0 done, 2 for any mistake in the flags or the inputs (the message says what and where),
1 when a Ray task fails, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import re
import shlex
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# Module-level imports stay light (stdlib only): Ray workers import this module to run
# `_encode_block`, and importing `minilm` pulls in torch.

EXIT_USAGE = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".txt": "txt", ".parquet": "parquet"}
# the skip reasons counted in the manifest's skipped_by_reason
REASONS = ("malformed_json", "not_an_object", "missing_text_field", "non_string_text", "invalid_utf8",
           "empty_text")
MAX_SKIP_WARNINGS = 10

# A Ray Data block holds about BLOCK_BYTES of text (or BLOCK_DOCS documents); the driver hands Ray
# WAVE_BYTES of text at a time, so memory stays bounded whatever the corpus size.
BLOCK_BYTES = 256 << 10
BLOCK_DOCS = 4096
WAVE_BYTES = 256 << 20


class UserError(Exception):
    """A mistake in the flags or the inputs: reported as `error: ...`, exit status 2."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


class _Terminated(BaseException):
    """SIGTERM, turned into an exception so the temporary output folder is removed."""


# ---- the command line --------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ray_jobs.prepare",
        description="Tokenize and pack text into parquet shards of seq_len+1 token rows (docs/data.md).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Inputs: .jsonl/.ndjson (one JSON object per line), .txt (one document per file), "
               ".parquet (one document per row), datasets save_to_disk folders; directories are walked "
               "recursively and globs expanded, in sorted order.")
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="files, directories or glob patterns, read in the order given")
    p.add_argument("--output", required=True, metavar="DIR", help="the prepared dataset to write")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", metavar="PATH",
                     help="an existing tokenizer.json (or a folder holding one) with <|endoftext|>=0, "
                          "<|im_start|>=1, <|im_end|>=2")
    tok.add_argument("--vocab-size", type=int, default=None, metavar="N",
                     help="train a byte-level BPE of N tokens on the input (default 6400)")
    p.add_argument("--seq-len", type=int, default=512, metavar="N",
                   help="tokens per training sequence; rows hold N+1 (default 512)")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="JSON key / column holding the text (default: text)")
    p.add_argument("--on-bad-record", choices=["error", "skip"], default="error",
                   help="stop at the first bad record (default) or skip and count it")
    p.add_argument("--rows-per-shard", type=int, default=None, metavar="N",
                   help="sequences per parquet shard (default 8192)")
    p.add_argument("--num-cpus", type=int, default=None, metavar="N",
                   help="CPUs of the local Ray started for this run (default: all cores, at least 2); "
                        "ignored when connecting to a running Ray (RAY_ADDRESS)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DIR if it already holds a prepared dataset")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from minilm.tokenizer import DEFAULT_VOCAB_SIZE, MIN_VOCAB_SIZE

    if args.seq_len < 1:
        p.error(f"--seq-len must be at least 1, got {args.seq_len}")
    if args.vocab_size is not None and args.vocab_size < MIN_VOCAB_SIZE:
        p.error(f"--vocab-size {args.vocab_size} is too small: a byte-level BPE needs at least "
                f"{MIN_VOCAB_SIZE} (3 special tokens + 256 bytes); MiniMind uses {DEFAULT_VOCAB_SIZE}")
    if args.rows_per_shard is not None and args.rows_per_shard < 1:
        p.error(f"--rows-per-shard must be at least 1, got {args.rows_per_shard}")
    if args.num_cpus is not None and args.num_cpus < 1:
        p.error(f"--num-cpus must be at least 1, got {args.num_cpus}")
    if not args.text_field:
        p.error("--text-field must not be empty")


# ---- inputs ------------------------------------------------------------------------------------------

@dataclass
class Source:
    path: Path
    display: str  # the path as the user would recognise it (given, globbed or walked)
    kind: str  # jsonl | txt | parquet | hf
    bytes: int


def _is_hf_dataset(p: Path) -> bool:
    return (p / "dataset_info.json").is_file() and (p / "state.json").is_file()


def _is_hf_dict(p: Path) -> bool:
    return (p / "dataset_dict.json").is_file()


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def resolve_inputs(specs: list[str], exclude: Path | None = None,
                   warn: Callable[[str], None] = lambda m: None) -> list[Source]:
    """Expand globs and directories (sorted) into the ordered list of sources; refuse what is unusable."""
    sources: list[Source] = []
    seen: dict[Path, str] = {}
    ignored: dict[str, list[str]] = {}
    exclude_re = None
    if exclude is not None:
        exclude = exclude.resolve()
        exclude_re = re.compile(re.escape(exclude.name) + r"(\.(tmp|old)-\d+)?")

    def excluded(p: Path) -> bool:
        return exclude_re is not None and p.resolve().parent == exclude.parent and bool(
            exclude_re.fullmatch(p.name))

    def add(p: Path, display: str, kind: str) -> None:
        key = p.resolve()
        if key in seen:
            warn(f"{display} is the same input as {seen[key]}; reading it once")
            return
        seen[key] = display
        size = _dir_bytes(p) if kind == "hf" else p.stat().st_size
        sources.append(Source(path=p, display=display, kind=kind, bytes=size))

    visited: set[Path] = set()

    def walk(d: Path, display: str, top: str) -> None:
        if d.resolve() in visited:  # a symlink loop, or a folder reached twice
            return
        visited.add(d.resolve())
        for child in sorted(d.iterdir(), key=lambda c: c.name):
            shown = os.path.join(display, child.name)
            if child.name.startswith(".") or excluded(child):
                continue
            if child.is_dir():
                if _is_hf_dataset(child):
                    add(child, shown, "hf")
                elif not _is_hf_dict(child):
                    walk(child, shown, top)
                else:
                    ignored.setdefault(top, []).append(shown + "/ (a DatasetDict)")
            elif child.is_file():
                kind = FORMATS.get(child.suffix.lower())
                if kind:
                    add(child, shown, kind)
                else:
                    ignored.setdefault(top, []).append(shown)

    def add_path(spec_path: str, explicit: bool, top: str) -> None:
        p = Path(spec_path)
        if p.is_dir():
            if _is_hf_dataset(p):
                add(p, spec_path, "hf")
            elif _is_hf_dict(p):
                splits = ""
                try:
                    splits = ", ".join(json.loads((p / "dataset_dict.json").read_text()).get("splits", []))
                except (OSError, ValueError, AttributeError):
                    pass
                raise UserError(f"input {spec_path} is a datasets DatasetDict (splits: {splits or '?'}); "
                                f"pass one split's folder, e.g. {os.path.join(spec_path, 'train')}")
            else:
                walk(p, spec_path, top)
        elif p.is_file():
            kind = FORMATS.get(p.suffix.lower())
            if kind:
                add(p, spec_path, kind)
            elif explicit:
                raise UserError(f"input {spec_path}: unsupported file type {p.suffix or '(no suffix)'!r}; use "
                                f".jsonl, .txt, .parquet or a datasets save_to_disk folder")
            else:
                ignored.setdefault(top, []).append(spec_path)
        elif explicit:
            raise UserError(f"input {spec_path} does not exist")

    for spec in specs:
        if glob.has_magic(spec):
            matches = sorted(m for m in glob.glob(spec, recursive=True) if not excluded(Path(m)))
            if not matches:
                raise UserError(f"input {spec}: no file matches this pattern")
            for m in matches:
                add_path(m, explicit=False, top=spec)
        else:
            if not os.path.exists(spec):
                raise UserError(f"input {spec} does not exist")
            add_path(spec, explicit=True, top=spec)
    for top, names in ignored.items():
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        warn(f"ignoring {len(names)} file(s) of unsupported type in {top}: {', '.join(names[:3])}{more} "
             f"(inputs are .jsonl, .txt, .parquet and datasets save_to_disk folders)")
    if not sources:
        raise UserError("no input files found in " + " ".join(specs) +
                        " (inputs are .jsonl, .txt, .parquet and datasets save_to_disk folders)")
    return sources


# ---- reading and checking records --------------------------------------------------------------------

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


def _read_jsonl(src: Source, text_field: str) -> Iterator[tuple[str, str | Bad, int]]:
    with open(src.path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            line = raw.rstrip(b"\r\n")
            if not line.strip():
                continue
            where = f"{src.display}:{lineno}"
            try:
                s = line.decode("utf-8")
            except UnicodeDecodeError as e:
                yield where, Bad("invalid_utf8", _utf8_detail(line, e)[1]), len(raw)
                continue
            try:
                obj = json.loads(s)
            except json.JSONDecodeError as e:
                yield where, Bad("malformed_json", f"malformed JSON ({e.msg} at column {e.colno})"), len(raw)
                continue
            if not isinstance(obj, dict):
                yield where, Bad("not_an_object", f"a JSON {type(obj).__name__}, not an object with "
                                                  f"{text_field!r}"), len(raw)
                continue
            if text_field not in obj:
                keys = ", ".join(list(obj)[:5]) or "none"
                yield where, Bad("missing_text_field", f"no {text_field!r} field (keys: {keys})"), len(raw)
                continue
            yield where, _check_text(obj[text_field], text_field), len(raw)


def _read_txt(src: Source, text_field: str) -> Iterator[tuple[str, str | Bad, int]]:
    raw = src.path.read_bytes()
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line, detail = _utf8_detail(raw, e)
        yield f"{src.display}:{line}", Bad("invalid_utf8", detail), len(raw)
        return
    if text.strip():
        yield f"{src.display}:1", text, len(raw)


def _read_columnar(src: Source, text_field: str, batches: Iterator, names: list[str], col_type,
                   num_rows: int) -> Iterator[tuple[str, str | Bad, int]]:
    import pyarrow as pa

    if text_field not in names:
        detail = f"no {text_field!r} column (columns: {', '.join(names[:8]) or 'none'})"
        for row in range(1, num_rows + 1):
            yield f"{src.display}: row {row}", Bad("missing_text_field", detail), 0
        return
    is_text = pa.types.is_string(col_type) or pa.types.is_large_string(col_type) or \
        pa.types.is_binary(col_type) or pa.types.is_large_binary(col_type) or \
        str(col_type) in ("string_view", "binary_view")
    row = 0
    for batch in batches:
        col = batch.column(text_field) if isinstance(batch, pa.Table) else batch.column(
            batch.schema.get_field_index(text_field))
        if not is_text:
            for _ in range(len(col)):
                row += 1
                yield f"{src.display}: row {row}", Bad(
                    "non_string_text", f"column {text_field!r} has type {col_type}, not string"), 0
            continue
        for value in col.cast(pa.large_binary()).to_pylist():
            row += 1
            where = f"{src.display}: row {row}"
            if value is None:
                yield where, Bad("non_string_text", f"{text_field!r} is null, not a string"), 0
                continue
            try:
                text = value.decode("utf-8")
            except UnicodeDecodeError as e:
                yield where, Bad("invalid_utf8", _utf8_detail(value, e)[1]), len(value)
                continue
            yield where, _check_text(text, text_field), len(value)


def _read_parquet(src: Source, text_field: str) -> Iterator[tuple[str, str | Bad, int]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(src.path)
        schema = pf.schema_arrow
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a file that is not parquet
        raise UserError(f"{src.display}: not a readable parquet file ({e})") from None
    cols = [text_field] if text_field in schema.names else []
    col_type = schema.field(text_field).type if cols else None
    batches = pf.iter_batches(batch_size=8192, columns=cols) if cols else iter(())
    try:
        yield from _read_columnar(src, text_field, batches, schema.names, col_type, pf.metadata.num_rows)
    except UserError:
        raise
    except OSError as e:
        raise UserError(f"{src.display}: cannot read parquet data ({e})") from None


def _read_hf(src: Source, text_field: str) -> Iterator[tuple[str, str | Bad, int]]:
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_from_disk(str(src.path))
    except Exception as e:  # datasets raises FileNotFoundError / various for a damaged folder
        raise UserError(f"{src.display}: cannot load the datasets folder ({type(e).__name__}: {e})") from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    if not isinstance(ds, datasets.Dataset):
        raise UserError(f"{src.display}: is a {type(ds).__name__}, not a single Dataset; pass one split's folder")
    names = list(ds.column_names)
    col_type = ds.data.schema.field(text_field).type if text_field in names else None
    batches = ds.with_format("arrow").iter(batch_size=8192) if text_field in names else iter(())
    yield from _read_columnar(src, text_field, batches, names, col_type, ds.num_rows)


READERS = {"jsonl": _read_jsonl, "txt": _read_txt, "parquet": _read_parquet, "hf": _read_hf}


class SkipWarnings:
    """Prints the first few skipped records (each once, though the tokenizer pass reads them too)."""

    def __init__(self, warn: Callable[[str], None], limit: int = MAX_SKIP_WARNINGS):
        self.warn = warn
        self.limit = limit
        self.shown: set[str] = set()

    def __call__(self, where: str, detail: str) -> None:
        if where in self.shown or len(self.shown) >= self.limit:
            return
        self.shown.add(where)
        self.warn(f"skipping {where}: {detail}" + (f" (showing the first {self.limit} skips; the manifest "
                                                   f"counts them all)" if len(self.shown) == self.limit else ""))


class RecordReader:
    """Yields (text, utf8_bytes) of every usable record, in input order, counting what it skips.

    In `error` mode the first bad record raises UserError naming file:line; empty texts are always
    skipped and counted (`empty_text`), never an error.
    """

    def __init__(self, sources: list[Source], text_field: str, on_bad: str,
                 warn: Callable[[str, str], None] | None = None):
        self.sources = sources
        self.text_field = text_field
        self.on_bad = on_bad
        self.warn = warn
        self.skipped: Counter[str] = Counter()
        self.examples: list[str] = []
        self.empty_inputs: list[str] = []
        self.documents = 0
        self.text_bytes = 0
        self.per_source = [{"documents": 0, "skipped": 0} for _ in sources]
        self._current = 0

    def _skip(self, src: Source, where: str, bad: Bad) -> None:
        if self.on_bad == "error" and bad.reason != "empty_text":
            raise UserError(f"{where}: {bad.detail}",
                            hint="pass --on-bad-record skip to skip bad records (they are counted in the manifest)")
        self.skipped[bad.reason] += 1
        self.per_source[self._current]["skipped"] += 1
        if len(self.examples) < 100:
            self.examples.append(f"{where}: {bad.detail}")
        if self.warn is not None:
            self.warn(where, bad.detail)

    def __iter__(self) -> Iterator[tuple[str, int]]:
        for i, src in enumerate(self.sources):
            self._current = i
            records = 0
            for where, rec, _ in self._read(src):
                records += 1
                if isinstance(rec, Bad):
                    self._skip(src, where, rec)
                    continue
                try:
                    nbytes = len(rec.encode("utf-8"))
                except UnicodeEncodeError as e:  # a lone surrogate, from a \ud800 escape in JSON
                    self._skip(src, where, Bad("invalid_utf8", f"{self.text_field!r} holds a lone surrogate "
                                                               f"{rec[e.start]!r}: not valid Unicode"))
                    continue
                self.per_source[i]["documents"] += 1
                self.documents += 1
                self.text_bytes += nbytes
                yield rec, nbytes
            if records == 0:
                if self.on_bad == "error":
                    raise UserError(f"{src.display}: the input is empty (no records)",
                                    hint="remove it, or pass --on-bad-record skip to skip empty inputs")
                self.empty_inputs.append(src.display)
                if self.warn is not None:
                    self.warn(src.display, "the input is empty (no records)")

    def _read(self, src: Source) -> Iterator[tuple[str, str | Bad, int]]:
        try:
            yield from READERS[src.kind](src, self.text_field)
        except OSError as e:
            raise UserError(f"{src.display}: cannot read it ({e.strerror or e})") from None

    @property
    def documents_skipped(self) -> int:
        return sum(self.skipped.values())


# ---- progress ------------------------------------------------------------------------------------------

def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


class Progress:
    """A live `\\r` line on a terminal (stderr a TTY); otherwise quiet until the summary."""

    def __init__(self, stream=None, interval: float = 0.5):
        self.stream = stream or sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval
        self.start = time.perf_counter()
        self._last = 0.0
        self._shown = False

    def restart(self, status: str | None = None) -> None:
        """Count rates from now (after Ray has started); on a terminal, show `status` meanwhile."""
        self.start = time.perf_counter()
        if status and self.live:
            self.stream.write(f"\r\033[K{status}")
            self.stream.flush()
            self._shown = True

    def message(self, text: str) -> None:
        if self._shown:
            self.stream.write("\r\033[K")
            self._shown = False
        print(text, file=self.stream, flush=True)

    def update(self, docs: int, tokens: int, text_bytes: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.live or (not force and now - self._last < self.interval):
            return
        self._last = now
        dt = max(now - self.start, 1e-9)
        self.stream.write(f"\r\033[Kprepare: {docs:,} docs ({_si(docs / dt)}/s), {_si(tokens)} tokens "
                          f"({_si(tokens / dt)}/s), {text_bytes / 1e6:.1f} MB text ({text_bytes / 1e6 / dt:.2f} MB/s)")
        self.stream.flush()
        self._shown = True

    def done(self) -> None:
        if self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._shown = False


# ---- the Ray side ----------------------------------------------------------------------------------------

_TOKENIZER_CACHE: dict[str, object] = {}


def _encode_block(batch, tokenizer_json: str, tokenizer_sha256: str, eos_id: int):
    """Ray Data UDF: a block of {"doc", "text"} -> {"doc", "ids"} with EOS after every document."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one Ray CPU per task: no extra threads
    import numpy as np
    import pyarrow as pa

    tok = _TOKENIZER_CACHE.get(tokenizer_sha256)
    if tok is None:
        from tokenizers import Tokenizer

        tok = _TOKENIZER_CACHE[tokenizer_sha256] = Tokenizer.from_str(tokenizer_json)
    texts = batch.column("text").to_pylist()
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast (no offsets) since tokenizers 0.20
    encodings = encode(texts, add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) + 1 for e in encodings), dtype=np.int64, count=len(encodings))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.empty(int(offsets[-1]), dtype=np.int32)
    for i, e in enumerate(encodings):
        flat[offsets[i]: offsets[i + 1] - 1] = e.ids
    flat[offsets[1:] - 1] = eos_id
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
    return pa.table({"doc": batch.column("doc"), "ids": ids})


_RAY_DATA_LOGGERS = ("ray.data", "ray.data._internal.execution.streaming_executor",
                     "ray.data._internal.progress")


def start_ray(num_cpus: int | None, warn: Callable[[str], None] = lambda m: None) -> bool:
    """Use the running Ray, or RAY_ADDRESS's, or start a local one; True when this call started it."""
    import ray

    if ray.is_initialized():
        if num_cpus:
            warn("--num-cpus is ignored: this process already runs Ray")
        return False
    if os.environ.get("RAY_ADDRESS"):
        if num_cpus:
            warn(f"--num-cpus is ignored: connecting to the running Ray at RAY_ADDRESS={os.environ['RAY_ADDRESS']}")
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, logging_level=logging.ERROR)
    else:
        ray.init(num_cpus=num_cpus or max(2, os.cpu_count() or 2), include_dashboard=False,
                 log_to_driver=False, logging_level=logging.ERROR)
    return True


@contextmanager
def _data_context():
    """Ordered, quiet Ray Data execution for this run; the process-wide context and log levels are
    restored after (prepare may run inside another Ray program, e.g. pretrain's demo data)."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    levels = {name: logging.getLogger(name).level for name in _RAY_DATA_LOGGERS}
    saved = {k: getattr(ctx, k) for k in ("enable_progress_bars", "print_on_execution_start",
                                          "enable_auto_log_stats") if hasattr(ctx, k)}
    saved_order = ctx.execution_options.preserve_order
    try:
        for k in saved:
            setattr(ctx, k, False)
        ctx.execution_options.preserve_order = True
        for name in levels:
            logging.getLogger(name).setLevel(logging.ERROR)
        yield ctx
    finally:
        for k, v in saved.items():
            setattr(ctx, k, v)
        ctx.execution_options.preserve_order = saved_order
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _blocks(reader: RecordReader) -> Iterator[list[tuple[int, list[str], int]]]:
    """Waves of blocks (first_doc, texts, text_bytes), in input order."""
    wave: list[tuple[int, list[str], int]] = []
    texts: list[str] = []
    first = block_bytes = wave_bytes = 0
    doc = 0
    for text, nbytes in reader:
        texts.append(text)
        block_bytes += nbytes
        doc += 1
        if block_bytes >= BLOCK_BYTES or len(texts) >= BLOCK_DOCS:
            wave.append((first, texts, block_bytes))
            wave_bytes += block_bytes
            first, texts, block_bytes = doc, [], 0
            if wave_bytes >= WAVE_BYTES:
                yield wave
                wave, wave_bytes = [], 0
    if texts:
        wave.append((first, texts, block_bytes))
    if wave:
        yield wave


def tokenize_and_pack(reader: RecordReader, writer, tokenizer_json: str, tokenizer_sha256: str,
                      eos_id: int, num_cpus: int | None, progress: Progress, stats: dict) -> None:
    """Run the Ray Data pipeline wave by wave, feeding `writer` in input order.

    Ray is started (or joined) only once the first wave is read, so bad inputs fail fast without it.
    `stats` receives started_ray, ray_start_s and text_bytes.
    """
    import numpy as np

    ray_ready = False
    next_doc = 0
    done_bytes = 0
    for wave in _blocks(reader):
        import pyarrow as pa

        if not ray_ready:
            t0 = time.perf_counter()
            progress.restart("prepare: starting Ray ...")
            stats["started_ray"] = start_ray(num_cpus, lambda m: progress.message(f"warning: {m}"))
            stats["ray_start_s"] = time.perf_counter() - t0
            progress.restart("prepare: tokenizing ...")
            ray_ready = True
        import ray
        import ray.data

        bytes_by_first = {first: nbytes for first, _, nbytes in wave}
        with _data_context():
            refs = [ray.put(pa.table({"doc": pa.array(np.arange(first, first + len(texts), dtype=np.int64)),
                                      "text": pa.array(texts, pa.large_string())}))
                    for first, texts, _ in wave]
            ds = ray.data.from_arrow_refs(refs).map_batches(
                _encode_block, batch_format="pyarrow", batch_size=None, num_cpus=1,
                fn_kwargs={"tokenizer_json": tokenizer_json, "tokenizer_sha256": tokenizer_sha256,
                           "eos_id": eos_id})
            for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=2):
                if batch.num_rows == 0:
                    continue
                docs = batch.column("doc").to_numpy()
                if docs[0] != next_doc or (len(docs) > 1 and np.any(np.diff(docs) != 1)):
                    raise RuntimeError(f"Ray Data returned documents out of order (expected {next_doc}, got "
                                       f"{docs[0]}..{docs[-1]}); refusing to write a non-deterministic dataset")
                next_doc = int(docs[-1]) + 1
                writer.add_stream(batch.column("ids").combine_chunks().flatten().to_numpy(),
                                  documents=len(docs))
                done_bytes += sum(bytes_by_first.pop(d, 0) for d in list(bytes_by_first) if d <= docs[-1])
                progress.update(writer.result.documents, writer.result.stream_tokens, done_bytes)
        del refs
    if next_doc != reader.documents:
        raise RuntimeError(f"{reader.documents} documents were sent to Ray but {next_doc} came back")
    stats["text_bytes"] = done_bytes


# ---- the run -------------------------------------------------------------------------------------------

def run(args: argparse.Namespace, argv: list[str], progress: Progress | None = None,
        stats: dict | None = None) -> dict:
    """Prepare the dataset `args` describe. Returns {"manifest", "stats"}; raises UserError.

    `stats` (timings, counts, whether this run started Ray) is filled in as the run goes, so a
    caller can shut down a Ray this run started even when it fails.
    """
    from minilm import packing
    from minilm import tokenizer as T
    from minilm.data import file_sha256

    progress = progress or Progress()
    warn = lambda m: progress.message(f"warning: {m}")  # noqa: E731
    skip_warn = SkipWarnings(warn)
    t_start = time.perf_counter()
    output = Path(args.output)
    sources = resolve_inputs(args.input, exclude=output, warn=warn)
    out = packing.AtomicOutput(output, overwrite=args.overwrite)
    stats = {} if stats is None else stats
    try:
        tok_path = out.tmp / packing.TOKENIZER_FILE
        t0 = time.perf_counter()
        if args.tokenizer:
            tok = T.load_tokenizer(args.tokenizer)
            src_path = Path(args.tokenizer)
            src_path = src_path / "tokenizer.json" if src_path.is_dir() else src_path
            shutil.copyfile(src_path, tok_path)
            source = os.path.abspath(src_path)
        else:
            vocab = args.vocab_size or T.DEFAULT_VOCAB_SIZE
            train_reader = RecordReader(sources, args.text_field, args.on_bad_record, warn=skip_warn)
            tok = T.train_tokenizer((text for text, _ in train_reader), vocab)
            if train_reader.documents == 0:
                raise _no_records(train_reader)
            T.save_tokenizer(tok, tok_path)
            source = "trained"
            stats["tokenizer_trained_on_documents"] = train_reader.documents
        stats["tokenizer_s"] = time.perf_counter() - t0
        tokenizer_json = tok_path.read_text(encoding="utf-8")
        tok_sha = file_sha256(tok_path)
        ids = T.special_ids(tok)

        reader = RecordReader(sources, args.text_field, args.on_bad_record, warn=skip_warn)
        writer = packing.ShardWriter(out.tmp, args.seq_len, args.rows_per_shard or packing.DEFAULT_ROWS_PER_SHARD,
                                     eos_id=ids["eos_token_id"])
        t0 = time.perf_counter()
        try:
            tokenize_and_pack(reader, writer, tokenizer_json, tok_sha, ids["eos_token_id"], args.num_cpus,
                              progress, stats)
        finally:
            progress.done()
        stats["pipeline_s"] = time.perf_counter() - t0 - stats.get("ray_start_s", 0.0)
        if reader.documents == 0:
            raise _no_records(reader)
        result = writer.close()
        if result.num_sequences == 0:
            raise UserError(f"the inputs give {result.stream_tokens} tokens ({reader.documents} documents), fewer "
                            f"than one sequence of seq_len + 1 = {args.seq_len + 1}; use a smaller --seq-len "
                            f"or more text")
        manifest = packing.build_manifest(
            result,
            tokenizer={"path": packing.TOKENIZER_FILE, "source": source, "sha256": tok_sha,
                       "vocab_size": T.vocab_size_of(tok), **ids},
            inputs=[{"path": os.path.abspath(s.path), "bytes": s.bytes, "format": s.kind, **counts}
                    for s, counts in zip(sources, reader.per_source, strict=True)],
            documents_read=reader.documents,
            documents_skipped=reader.documents_skipped,
            skipped_by_reason=dict(reader.skipped),
            command="python -m ray_jobs.prepare " + shlex.join(argv),
            extra={"text_field": args.text_field, "on_bad_record": args.on_bad_record,
                   "rows_per_shard": writer.rows_per_shard, "text_bytes": reader.text_bytes,
                   "document_tokens": result.stream_tokens, "empty_inputs": reader.empty_inputs,
                   "skipped_examples": reader.examples[:20]},
        )
        packing.write_manifest(out.tmp, manifest)
        out.commit()
    finally:
        out.abort()
    stats["elapsed_s"] = time.perf_counter() - t_start
    stats["documents"] = reader.documents
    stats["tokens"] = result.stream_tokens
    return {"manifest": manifest, "stats": stats, "reader": reader}


def _no_records(reader: RecordReader) -> UserError:
    parts = [f"{n} {r}" for r, n in sorted(reader.skipped.items())]
    if reader.empty_inputs:
        parts.append(f"{len(reader.empty_inputs)} empty input(s)")
    return UserError("the inputs hold no usable record" + (f" ({', '.join(parts)})" if parts else ""))


def summary_line(output: str, manifest: dict, stats: dict) -> str:
    m = manifest
    skipped = ""
    if m["documents_skipped"] or m.get("empty_inputs"):
        reasons = ", ".join(f"{r} {n}" for r, n in m["skipped_by_reason"].items())
        if m.get("empty_inputs"):
            reasons += (", " if reasons else "") + f"empty inputs {len(m['empty_inputs'])}"
        skipped = f"; skipped {m['documents_skipped']} record(s) ({reasons})"
    dt = max(stats.get("pipeline_s", 0.0), 1e-9)
    return (f"prepared {output}: {m['num_sequences']:,} sequences of {m['seq_len']}+1 tokens in "
            f"{len(m['shards'])} shard(s) from {m['documents_read']:,} documents "
            f"({m['document_tokens']:,} tokens, {m['dropped_tail_tokens']} tail tokens dropped){skipped}; "
            f"tokenized at {m['text_bytes'] / 1e6 / dt:.2f} MB/s, {_si(m['document_tokens'] / dt)} tokens/s; "
            f"{stats.get('elapsed_s', 0.0):.1f}s in all (Ray start {stats.get('ray_start_s', 0.0):.1f}s, "
            f"tokenizer {stats.get('tokenizer_s', 0.0):.1f}s); fingerprint {m['fingerprint'][:16]}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        check_args(parser, args)
    except SystemExit as e:  # argparse: usage errors exit 2, --help exits 0
        return int(e.code or 0)

    from minilm.packing import OutputError
    from minilm.tokenizer import TokenizerError

    def on_term(signum, frame):
        raise _Terminated()

    in_main = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, on_term) if in_main else None
    progress = Progress()
    stats: dict = {}
    try:
        outcome = run(args, argv, progress, stats)
    except (UserError, OutputError, TokenizerError) as e:
        progress.message(f"error: {e}")
        if getattr(e, "hint", None):
            progress.message(f"hint: {e.hint}")
        return EXIT_USAGE
    except (KeyboardInterrupt, _Terminated):
        progress.message(f"interrupted: nothing was written to {args.output}")
        return EXIT_INTERRUPTED
    except Exception as e:
        if type(e).__module__.startswith("ray"):
            progress.message(f"error: a Ray task failed while tokenizing: {e}")
            return EXIT_FAILED
        raise
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, old_term)
        if stats.get("started_ray"):
            import ray

            ray.shutdown()
    progress.message(summary_line(args.output, outcome["manifest"], outcome["stats"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
