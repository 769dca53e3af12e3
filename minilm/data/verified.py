"""Hashes checked once per machine: a stamp per dataset under the cache (`fsio.NodeStamp`), taken under a file lock."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..fsio import NodeStamp
from .format import TOKENIZER_FILE, DataError, PreparedData, _files, _hash_mismatch, cache_root, file_sha256


def _stamp(data: PreparedData) -> NodeStamp:
    return NodeStamp(cache_root() / "verified", data._local(), data.fingerprint)


def verify_hashes(data: PreparedData) -> None:
    """Check every file's sha256 against the manifest, and every token id against the vocabulary, once per file on
    this machine (`fsio.NodeStamp`): against a wrong, partial, replaced or hand-edited file, not bit rot."""
    folder = data._local()
    with _stamp(data) as stamp:
        for name, _, sha in _files(data.manifest):
            path, dtype = folder / name, None if name == TOKENIZER_FILE else data.token_dtype
            found = stamp.known(name)
            if found[:1] != [sha]:
                got = file_sha256(path)
                if got != sha:
                    raise DataError(_hash_mismatch(str(path), got, sha))
                found = [sha]
            if len(found) < 2:  # a stamp from a writer, which hashed the bytes but did not range-check them
                found = [sha, _top_id(path, dtype)]
            if found[1] >= data.vocab_size:  # an id the model's embedding has no row for
                raise DataError(f"{path}: token id {found[1]} is not below the vocabulary size {data.vocab_size} of "
                                f"the tokenizer in manifest.json (a file edited by hand?); prepare the dataset again")
            stamp.vouch(name, *found)


def _top_id(path: Path, dtype) -> int:
    """The largest token id of a token file (-1 for the tokenizer, or no ids): one read, through the page cache."""
    if dtype is None or path.stat().st_size < dtype.itemsize:
        return -1
    return int(np.memmap(path, dtype, mode="r").max())


def record_verified(data: PreparedData) -> None:
    """Stamp every file of `data` as verified, for a writer that hashed the bytes as it wrote them."""
    with _stamp(data) as stamp:
        for name, _, sha in _files(data.manifest):
            stamp.vouch(name, sha)
