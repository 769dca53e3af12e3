"""Packing token ids into rows of `seq_len + 1`, written as the token files of docs/data.md: shards hashed as they
are written (memory stays at one chunk), in a folder renamed into place after its manifest."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import fsio
from .data import FORMAT, MANIFEST, TOKEN_DTYPES, TOKENIZER_FILE
from .rows import BestFitRows, BestFitStats
from .tokenizer import BOS_ID, EOS_ID

SHARD_NAME = "shard-{:05d}.bin"
# Few enough files for a 10B-token corpus, small enough to copy and hash one at a time.
SHARD_BYTES = 256 << 20
_SHARD_RE = re.compile(r"shard-\d{5}\.bin")


class OutputError(ValueError):
    """The output directory cannot be used (it holds other data, or is not a directory)."""


def default_rows_per_shard(seq_len: int, token_dtype: str) -> int:
    return max(1, SHARD_BYTES // ((seq_len + 1) * TOKEN_DTYPES[token_dtype].itemsize))


@dataclass
class PackResult:
    seq_len: int
    token_dtype: str
    shards: list[dict] = field(default_factory=list)  # {"file", "first_sample_id", "num_sequences", "bytes", "sha256"}
    num_sequences: int = 0
    documents: int = 0
    stream_tokens: int = 0  # document tokens plus one EOS per document
    dropped_tail_tokens: int = 0
    num_tokens = property(lambda self: self.num_sequences * (self.seq_len + 1))


class ShardWriter:
    """Streams documents (or an EOS-separated token stream) into token files in `directory`; an id that does not
    fit `token_dtype` is an error, never a silent wrap-around."""

    def __init__(self, directory: str | os.PathLike, seq_len: int, rows_per_shard: int | None = None,
                 eos_id: int = EOS_ID, token_dtype: str = "uint16"):
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        if token_dtype not in TOKEN_DTYPES:
            raise ValueError(f"token_dtype must be one of {', '.join(TOKEN_DTYPES)}, got {token_dtype!r}")
        rows_per_shard = default_rows_per_shard(seq_len, token_dtype) if rows_per_shard is None else rows_per_shard
        if rows_per_shard < 1:
            raise ValueError(f"rows_per_shard must be at least 1, got {rows_per_shard}")
        self.directory = Path(directory)
        self.row_len = seq_len + 1
        self.rows_per_shard = rows_per_shard
        self.eos_id = eos_id
        self.dtype = TOKEN_DTYPES[token_dtype]
        self._max_id = np.iinfo(self.dtype).max
        self.result = PackResult(seq_len=seq_len, token_dtype=token_dtype)
        self._carry = np.zeros(0, self.dtype)  # fewer than row_len tokens, waiting for the rest of their row
        self._file = self._hash = None  # the token file being written, and its sha256 so far
        self._closed = False

    def add_document(self, ids: Sequence[int]) -> None:
        self.add_stream(np.append(np.asarray(ids, dtype=np.int64), self.eos_id), documents=1)

    def add_stream(self, tokens: np.ndarray, documents: int = 0, stream_tokens: int | None = None) -> None:
        """Append tokens that already carry an EOS after each document (`documents` of them); `stream_tokens`:
        how many input tokens they stand for, when a subclass has rearranged them into rows."""
        if self._closed:
            raise RuntimeError("ShardWriter is closed")
        tokens = np.asarray(tokens)
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > self._max_id):
            raise ValueError(f"token ids {int(tokens.min())}..{int(tokens.max())} do not fit "
                             f"{self.result.token_dtype}")
        tokens = tokens.astype(self.dtype, copy=False)
        self.result.stream_tokens += len(tokens) if stream_tokens is None else stream_tokens
        self.result.documents += documents
        buf = np.concatenate([self._carry, tokens]) if len(self._carry) else tokens
        pos, end = 0, len(buf) - len(buf) % self.row_len
        while pos < end:  # up to the end of the current token file at a time
            room = self.rows_per_shard - (self.result.shards[-1]["num_sequences"] if self._file else 0)
            take = min(end - pos, room * self.row_len)
            self._write(buf[pos: pos + take])
            pos += take
        self._carry = buf[end:].copy()

    def _write(self, tokens: np.ndarray) -> None:
        if self._file is None:
            name = SHARD_NAME.format(len(self.result.shards))
            self._file, self._hash = open(self.directory / name, "xb"), hashlib.sha256()
            self.result.shards.append({"file": name, "first_sample_id": self.result.num_sequences,
                                       "num_sequences": 0, "bytes": 0, "sha256": None})
        data = memoryview(np.ascontiguousarray(tokens)).cast("B")
        self._file.write(data)
        self._hash.update(data)
        n = len(tokens) // self.row_len
        shard = self.result.shards[-1]
        shard["num_sequences"] += n
        shard["bytes"] += len(data)
        self.result.num_sequences += n
        if shard["num_sequences"] == self.rows_per_shard:
            self._finish_shard()

    def _finish_shard(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.result.shards[-1]["sha256"] = self._hash.hexdigest()
        self._file = self._hash = None

    def close(self) -> PackResult:
        """Finish the last token file (whole rows only; the tail is dropped and counted) and return the totals."""
        if not self._closed:
            if self._file is not None:
                self._finish_shard()
            self.result.dropped_tail_tokens = len(self._carry)
            self._carry = self._carry[:0]
            self._closed = True
        return self.result

    def abort(self) -> None:
        """Close an unfinished token file (the caller removes the folder)."""
        if self._file is not None:
            self._file.close()
            self._file = None


class BosAlignedShardWriter(ShardWriter):
    """A ShardWriter of rows that each start with a document (`minilm.rows.BestFitRows`), for `prepare --rows
    best-fit` (`split_long`) or `bos-aligned`."""

    def __init__(self, directory: str | os.PathLike, seq_len: int, rows_per_shard: int | None = None,
                 eos_id: int = EOS_ID, token_dtype: str = "uint16", bos_id: int = BOS_ID, buffer_docs: int = 1000,
                 split_long: bool = False):
        super().__init__(directory, seq_len, rows_per_shard, eos_id=eos_id, token_dtype=token_dtype)
        self.best_fit = BestFitStats()
        self._packer = BestFitRows(seq_len + 1, bos_id=bos_id, eos_id=eos_id, buffer_docs=buffer_docs,
                                   stats=self.best_fit, split_long=split_long)

    def add_stream(self, tokens: np.ndarray, documents: int = 0) -> None:
        tokens = np.asarray(tokens)
        ends = np.flatnonzero(tokens == self.eos_id)
        rows, start = [], 0
        for end in ends:
            rows += self._packer.add(tokens[start:end])
            start = int(end) + 1
        self._write_rows(rows, documents, len(tokens))

    def close(self) -> PackResult:
        if not self._closed:
            self._write_rows(self._packer.finish(), 0, 0)
        return super().close()

    def _write_rows(self, rows: list, documents: int, stream_tokens: int) -> None:
        stream = np.concatenate(rows) if rows else np.zeros(0, np.int32)
        super().add_stream(stream, documents=documents, stream_tokens=stream_tokens)


def compute_fingerprint(tokenizer_sha256: str, seq_len: int, shard_sha256s: Sequence[str], token_dtype: str) -> str:
    """sha256 of the canonical JSON of what makes the rows: two datasets with the same fingerprint hold the
    same token rows in the same order, made with the same tokenizer."""
    payload = {"format": FORMAT, "seq_len": int(seq_len), "shards": list(shard_sha256s),
               "token_dtype": token_dtype, "tokenizer_sha256": tokenizer_sha256}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def build_manifest(result: PackResult, *, tokenizer: dict, inputs: list[dict], documents_read: int,
                   documents_skipped: int, skipped_by_reason: dict[str, int], command: str,
                   extra: dict | None = None) -> dict:
    """The manifest of docs/data.md. `tokenizer` holds path, source, sha256, vocab_size and special ids."""
    from . import __version__

    manifest = {
        "format": FORMAT, "seq_len": result.seq_len, "token_dtype": result.token_dtype,
        "num_sequences": result.num_sequences, "num_tokens": result.num_tokens,
        "dropped_tail_tokens": result.dropped_tail_tokens, "documents_read": documents_read,
        "documents_skipped": documents_skipped, "skipped_by_reason": dict(sorted(skipped_by_reason.items())),
        "shards": result.shards, "tokenizer": tokenizer, "inputs": inputs,
        "fingerprint": compute_fingerprint(tokenizer["sha256"], result.seq_len,
                                           [s["sha256"] for s in result.shards], result.token_dtype),
        "command": command, "created_by": f"minilm {__version__}",
    }
    if extra:
        manifest.update({k: v for k, v in extra.items() if k not in manifest})
    return manifest


def write_manifest(directory: str | os.PathLike, manifest: dict) -> Path:
    path = Path(directory) / MANIFEST
    fsio.write_atomic(path, json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    return path


def describe_existing(path: Path) -> str | None:
    """None when `path` is free to write (absent or empty); else what is there, in words."""
    if not path.exists():
        return None
    if not path.is_dir():
        return "a file that is not a directory"
    names = sorted(p.name for p in path.iterdir())
    if not names:
        return None
    if MANIFEST in names:
        try:
            m = fsio.loads((path / MANIFEST).read_text())
            return (f"a prepared dataset ({m.get('num_sequences')} sequences of seq_len {m.get('seq_len')}, "
                    f"fingerprint {str(m.get('fingerprint'))[:12]})")
        except (OSError, ValueError):
            return "a prepared dataset with an unreadable manifest.json"
    if all(n in (MANIFEST, MANIFEST + ".tmp", TOKENIZER_FILE) or _SHARD_RE.fullmatch(n) for n in names):
        return "an incomplete prepared dataset (no manifest.json)"
    return f"other files ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"


class AtomicOutput:
    """Builds DIR in its staging folder beside it and renames it into place on `commit()`; an existing prepared
    dataset is replaced only with `overwrite`, anything else there never."""

    def __init__(self, final: str | os.PathLike, overwrite: bool = False):
        self.final = Path(final)
        existing = describe_existing(self.final)
        if existing is not None:
            if existing.startswith("a file") or existing.startswith("other files"):
                raise OutputError(f"output {self.final} already exists and holds {existing}; refusing to "
                                  f"replace it (--overwrite only replaces a prepared dataset): choose "
                                  f"another --output")
            if not overwrite:
                raise OutputError(f"output {self.final} already holds {existing}; pass --overwrite to replace "
                                  f"it (this is refused even when the inputs are the same)")
        self.final.parent.mkdir(parents=True, exist_ok=True)
        fsio.sweep_staging(self.final.parent)  # left by a prepare that was killed
        self.tmp, self.replace = fsio.staging_dir(self.final.parent, self.final.name), existing is not None
        self.tmp.mkdir(mode=0o750)
        self.committed = False

    def commit(self) -> Path:
        """Move the finished temp folder to DIR (replacing an old dataset there)."""
        if not (self.tmp / MANIFEST).is_file():
            raise RuntimeError("commit() before the manifest was written")
        fsio.publish(self.tmp, self.final, self.replace)
        self.committed = True
        return self.final

    def abort(self) -> None:
        """Remove the temp folder (nothing of this run is left behind)."""
        if not self.committed:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> AtomicOutput:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.abort()

