"""Hashes checked once per machine: a stamp per dataset under the cache, taken under a file lock."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .format import TOKENIZER_FILE, DataError, PreparedData, _files, _hash_mismatch, cache_root, file_sha256

RACY_NS = 2_000_000_000  # a file modified this recently when hashed is hashed again next time


@contextmanager
def node_lock(lock_path: Path) -> Iterator[None]:
    """An exclusive lock between the processes of this node (the ranks and reader actors of a run)."""
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # no writable cache folder: go on unlocked (each process then does its own work)
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _stamp_path(folder: Path) -> Path:
    key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:32]
    return cache_root() / "verified" / f"{key}.json"


def file_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _read_stamp(stamp: Path, data: PreparedData) -> dict:
    try:
        saved = json.loads(stamp.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(saved, dict) or saved.get("fingerprint") != data.fingerprint:
        return {}
    files = saved.get("files")
    return files if isinstance(files, dict) else {}


def _write_stamp(stamp: Path, data: PreparedData, files: dict) -> None:
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_name(f"{stamp.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"path": str(data.path.resolve()), "fingerprint": data.fingerprint,
                                   "files": files}))
        os.replace(tmp, stamp)
        _prune_stamps(stamp.parent)
    except OSError:
        pass  # no writable cache: the next open hashes again


def _prune_stamps(folder: Path) -> None:
    """Forget datasets that no longer exist, so the stamps stay as many as the datasets on this machine."""
    for p in folder.glob("*.json"):
        try:
            if not Path(json.loads(p.read_text())["path"]).exists():
                p.unlink()
                p.with_suffix(".lock").unlink(missing_ok=True)
        except (OSError, ValueError, KeyError, TypeError):
            continue


def verify_hashes(data: PreparedData) -> None:
    """Check every file's sha256 against the manifest, and every token id against the vocabulary, once per file
    on this machine.

    A file whose (size, mtime, inode) were stamped with the right hash (and its largest token id) is not read
    again, so later opens by every rank and restart only stat the files; one rank of a node reads under the lock
    while the others wait. As in git's index, a file modified less than RACY_NS before it was hashed is not
    stamped. The check is against a wrong, partial, replaced or hand-edited file, not bit rot.
    """
    folder = data._local()
    stamp = _stamp_path(folder)
    with node_lock(stamp.with_suffix(".lock")):
        known = _read_stamp(stamp, data)
        fresh = {}
        for name, _, sha in _files(data.manifest):
            path, dtype = folder / name, None if name == TOKENIZER_FILE else data.token_dtype
            key, entry, racy = file_key(path), known.get(name, []), False
            if entry[:4] != [*key, sha]:
                got = file_sha256(path)
                if got != sha:
                    raise DataError(_hash_mismatch(str(path), got, sha))
                entry, racy = [*key, sha], key[1] > time.time_ns() - RACY_NS  # hashed, but too fresh to vouch for
            if len(entry) < 5:  # a stamp from a writer, which hashed the bytes but did not range-check them
                entry = [*entry[:4], _top_id(path, dtype)]
            if entry[4] >= data.vocab_size:  # an id the model's embedding has no row for
                raise DataError(f"{path}: token id {entry[4]} is not below the vocabulary size {data.vocab_size} of "
                                f"the tokenizer in manifest.json (a file edited by hand?); prepare the dataset again")
            if not racy:
                fresh[name] = entry
        if fresh != known:
            _write_stamp(stamp, data, fresh)


def _top_id(path: Path, dtype) -> int:
    """The largest token id of a token file (-1 for the tokenizer, or no ids): one read, through the page cache."""
    if dtype is None or path.stat().st_size < dtype.itemsize:
        return -1
    return int(np.memmap(path, dtype, mode="r").max())


def record_verified(data: PreparedData) -> None:
    """Stamp every file of `data` as verified, for a writer that hashed the bytes as it wrote them."""
    folder = data._local()
    stamp = _stamp_path(folder)
    with node_lock(stamp.with_suffix(".lock")):
        _write_stamp(stamp, data, {name: [*file_key(folder / name), sha] for name, _, sha in _files(data.manifest)})
