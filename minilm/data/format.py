"""The prepared-data format (docs/data.md): raw token files of rows of `seq_len + 1` ids, described by
`manifest.json`; the manifest's checks."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..safety import check_name, redact

MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
FORMAT = "minilm-packed-v2"
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


class DataError(ValueError):
    """Prepared data is missing, incomplete, or does not fit the run; the message says what and where."""

    def __init__(self, message: str):
        super().__init__(redact(message))  # a --data URI's credentials never reach a log or a terminal


def cache_root() -> Path:
    """Where minilm keeps node-local state: $MINILM_CACHE, else ~/.cache/minilm."""
    return Path(os.environ.get("MINILM_CACHE") or Path.home() / ".cache" / "minilm").expanduser()


def is_remote(location: str | os.PathLike) -> bool:
    """A URI with a scheme (s3://, gs://, file://, ...): read through pyarrow.fs and copied to each node."""
    return isinstance(location, str) and bool(_URI.match(location))


def token_dtype_for(vocab_size: int) -> str:
    """The narrowest token type that holds every id of a vocabulary: uint16 up to 65,536 tokens."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def file_sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@dataclass(frozen=True)
class PreparedData:
    """A checked manifest and where its files are: a local folder (`path`), or a remote URI (`uri`, path None)."""

    path: Path | None
    manifest: dict
    uri: str | None = None

    location = property(lambda self: self.uri if self.uri is not None else str(self.path))
    num_sequences = property(lambda self: int(self.manifest["num_sequences"]))
    seq_len = property(lambda self: int(self.manifest["seq_len"]))
    fingerprint = property(lambda self: str(self.manifest["fingerprint"]))
    tokenizer_sha256 = property(lambda self: str(self.manifest["tokenizer"]["sha256"]))
    vocab_size = property(lambda self: int(self.manifest["tokenizer"]["vocab_size"]))
    token_dtype = property(lambda self: TOKEN_DTYPES[self.manifest["token_dtype"]])
    num_bytes = property(lambda self: sum(int(s["bytes"]) for s in self.manifest["shards"]))
    tokenizer_path = property(lambda self: self._local() / TOKENIZER_FILE)
    shard_paths = property(lambda self: [self._local() / s["file"] for s in self.manifest["shards"]])

    def _local(self) -> Path:
        if self.path is None:
            raise DataError(f"{self.uri} is remote: read it through minilm.data.open_local, which copies it to "
                            f"this node")
        return self.path


def _files(manifest: dict) -> list[tuple[str, int | None, str]]:
    """(name, bytes or None, sha256) of every file the manifest lists: the tokenizer, then the shards."""
    return [(TOKENIZER_FILE, None, str(manifest["tokenizer"]["sha256"]))] + [
        (s["file"], int(s["bytes"]), str(s["sha256"])) for s in manifest["shards"]]


def check_manifest(manifest, where: str) -> None:
    """Refuse a manifest that is malformed, of another format, or inconsistent with itself."""
    got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
    if got != FORMAT:
        raise DataError(f"{where}: format {got!r} is not {FORMAT!r}")
    missing = [k for k in ("seq_len", "num_sequences", "shards", "tokenizer", "fingerprint", "token_dtype")
               if k not in manifest]
    if missing:
        raise DataError(f"{where}: missing {', '.join(missing)}")
    try:
        _check_layout(manifest, where)
    except DataError:
        raise
    except (KeyError, TypeError, ValueError, OverflowError) as e:  # a field of the wrong type, a shard without a key
        raise DataError(f"{where}: malformed ({type(e).__name__}: {e})"[:500]) from None


def _check_layout(manifest: dict, where: str) -> None:
    check_name(manifest["fingerprint"], f"{where}: fingerprint", DataError)  # it names the node-local copy's folder
    dtype_name = manifest["token_dtype"]
    if dtype_name not in TOKEN_DTYPES:
        raise DataError(f"{where}: token_dtype {dtype_name!r} is not one of {', '.join(TOKEN_DTYPES)}")
    vocab = int(manifest["tokenizer"]["vocab_size"])
    if TOKEN_DTYPES[token_dtype_for(vocab)].itemsize > TOKEN_DTYPES[dtype_name].itemsize:
        raise DataError(f"{where}: token_dtype {dtype_name} cannot hold the ids of a {vocab}-token vocabulary")
    row_bytes = (int(manifest["seq_len"]) + 1) * TOKEN_DTYPES[dtype_name].itemsize
    expected_first = 0
    for shard in manifest["shards"]:
        name = check_name(shard["file"], f"{where}: shard file name", DataError)
        if int(shard["first_sample_id"]) != expected_first:
            raise DataError(f"{where}: shard {name} starts at sample {shard['first_sample_id']}, expected "
                            f"{expected_first} (sample ids must be contiguous across shards)")
        n = int(shard["num_sequences"])
        if int(shard["bytes"]) != n * row_bytes:
            raise DataError(f"{where}: shard {name} lists {int(shard['bytes']):,} bytes, but {n:,} rows of "
                            f"seq_len + 1 = {int(manifest['seq_len']) + 1} {dtype_name} tokens take "
                            f"{n * row_bytes:,}: the manifest disagrees with itself")
        expected_first += n
    if expected_first != int(manifest["num_sequences"]):
        raise DataError(f"{where}: shard sizes do not add up to num_sequences {manifest['num_sequences']}")
    _files(manifest)  # a missing hash is "malformed" here, not a KeyError later


def _size_message(where: str, actual: int, expected: int) -> str:
    how = "truncated" if actual < expected else "longer than listed"
    return (f"{where} holds {actual:,} bytes but {MANIFEST} lists {expected:,} ({how}, or not this dataset's "
            f"file); prepare the dataset again")


def _hash_mismatch(where: str, got: str, want: str) -> str:
    return (f"{where}: sha256 {got[:16]}... does not match {MANIFEST}'s {want[:16]}... (the file changed or is "
            f"corrupt); prepare the dataset again")


def fit_configs(data: PreparedData, model_cfg, train_cfg, unset=()) -> str | None:
    """`check_compatible` for a run's configs once those of `unset` (seq_len, vocab_size: given by neither flag nor
    YAML) are the manifest's; the start line's note naming them."""
    taken = {name: getattr(data, name) for name in unset}
    for cfg in (model_cfg, train_cfg):
        for name in taken.keys() & cfg.__dataclass_fields__.keys():
            setattr(cfg, name, taken[name])
    check_compatible(data, vocab_size=model_cfg.vocab_size, seq_len=train_cfg.seq_len)
    if taken:
        return f"note: {' and '.join(f'{k} {v}' for k, v in taken.items())} from the data's manifest"
    return None


def check_compatible(data: PreparedData, *, vocab_size: int, seq_len: int) -> None:
    """Refuse data that does not fit the model before any worker starts."""
    problems = []
    if data.vocab_size > vocab_size:
        problems.append(f"its tokenizer has {data.vocab_size} tokens but the model's vocab_size is {vocab_size} "
                        f"(set --vocab-size {data.vocab_size})")
    if data.seq_len != seq_len:
        problems.append(f"it was packed with seq_len {data.seq_len} but the run asks for seq_len {seq_len} "
                        f"(set --seq-len {data.seq_len} or prepare again)")
    if problems:
        raise DataError(f"data {data.location} does not fit this run: " + "; ".join(problems))
