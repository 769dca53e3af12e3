"""Opening prepared data: `open_prepared` (a local folder checked, or a remote URI's manifest read) and `open_local`
(a remote URI, `s3://`, `gs://` or any pyarrow filesystem URI, copied once per node, verified on the way)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from ..fsio import create, loads, node_lock, publish, staged, write_atomic
from ..safety import join_uri
from .format import (
    MANIFEST,
    TOKENIZER_FILE,
    DataError,
    PreparedData,
    _files,
    _hash_mismatch,
    _size_message,
    cache_root,
    check_manifest,
    is_remote,
)
from .verified import record_verified, verify_hashes

COPY_CHUNK = 8 << 20


def _remote_fs(uri: str):
    import pyarrow.fs as pafs

    try:
        fs, root = pafs.FileSystem.from_uri(uri)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"cannot open {uri}: {e}") from None
    return fs, root.rstrip("/")


def _open_remote(uri: str) -> PreparedData:
    import pyarrow.fs as pafs

    uri = uri.rstrip("/")
    fs, root = _remote_fs(uri)
    try:
        if fs.get_file_info(f"{root}/{MANIFEST}").type == pafs.FileType.NotFound:
            raise DataError(f"{uri} has no {MANIFEST}: not a prepared dataset, or its prepare did not finish")
        with fs.open_input_stream(f"{root}/{MANIFEST}") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"cannot read {join_uri(uri, MANIFEST)}: {e}") from None
    manifest = _parse_manifest(raw, join_uri(uri, MANIFEST))
    files = _files(manifest)
    try:
        infos = fs.get_file_info([f"{root}/{name}" for name, _, _ in files])
    except OSError as e:
        raise DataError(f"cannot list {uri}: {e}") from None
    for (name, size, _), info in zip(files, infos, strict=True):
        if info.type == pafs.FileType.NotFound:
            raise DataError(f"{uri}: {name} listed in {MANIFEST} is missing")
        if size is not None and info.size != size:
            raise DataError(_size_message(join_uri(uri, name), info.size, size))
    return PreparedData(None, manifest, uri=uri)


def _parse_manifest(raw: bytes, where: str) -> dict:
    try:
        manifest = loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSON, UTF-8, an integer of > 4300 digits, nesting past the stack
        raise DataError(f"{where} is not valid JSON ({e})") from None
    check_manifest(manifest, where)
    return manifest


def open_prepared(path: str | os.PathLike, *, verify: bool = True) -> PreparedData:
    """Open a dataset written by `ray_jobs.prepare`, checking every file's size and (with `verify`, once per machine)
    its sha256; a remote URI's manifest and sizes are read remotely (`open_local` makes the copy readers use)."""
    if is_remote(path):
        return _open_remote(str(path))
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"data directory {path} does not exist (make one with `python -m ray_jobs.prepare`)")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise DataError(f"{path} has no {MANIFEST}: not a prepared dataset, or its prepare did not finish")
    manifest = _parse_manifest(mpath.read_bytes(), str(mpath))
    data = PreparedData(path, manifest)
    for name, size, _ in _files(manifest):
        try:
            actual = (path / name).stat().st_size
        except FileNotFoundError:
            what = "tokenizer.json" if name == TOKENIZER_FILE else f"token file {name} listed in {MANIFEST}"
            raise DataError(f"{path}: {what} is missing") from None
        if size is not None and actual != size:
            raise DataError(_size_message(str(path / name), actual, size))
    if verify:
        verify_hashes(data)
    return data


def open_local(data: str | os.PathLike) -> PreparedData:
    """`open_prepared` for a local folder; for a remote URI, the node-local copy under `cache_root()/data`, made once
    under a lock (each file checked as it arrives), then reused."""
    if not is_remote(data):
        return open_prepared(data)
    return materialise(_open_remote(str(data)))


def materialise(remote: PreparedData, cache: Path | None = None) -> PreparedData:
    """The verified local copy of `remote` (from `open_prepared(uri)`), copying it if this node lacks it."""
    cache = (cache or cache_root()) / "data"
    target = cache / remote.fingerprint[:32]
    with node_lock(cache / f"{target.name}.lock"):
        if (target / MANIFEST).is_file():
            try:
                local = open_prepared(target)
                if local.fingerprint == remote.fingerprint:
                    return local
            except DataError:
                pass  # a damaged copy: make it again
            shutil.rmtree(target)
        cache.mkdir(parents=True, exist_ok=True)
        need, free = remote.num_bytes + (1 << 20), shutil.disk_usage(cache).free
        if free < need:
            raise DataError(f"copying {remote.uri} ({need / 1e9:.2f} GB) to this node needs that much free space in "
                            f"{cache}, which has {free / 1e9:.2f} GB free (set MINILM_CACHE to a larger disk)")
        with staged(target) as tmp:  # what a killed copier left is swept (we hold the lock)
            tmp.mkdir(mode=0o750)
            fs, root = _remote_fs(remote.uri)
            for name, size, sha in _files(remote.manifest):
                _copy_verified(fs, f"{root}/{name}", tmp / name, size, sha, join_uri(remote.uri, name))
            write_atomic(tmp / MANIFEST, json.dumps(remote.manifest, indent=2))
            publish(tmp, target)
        record_verified(PreparedData(target, remote.manifest))
    return open_prepared(target)


def _copy_verified(fs, src: str, dst: Path, size: int | None, sha: str, where: str) -> None:
    h, copied = hashlib.sha256(), 0
    try:
        with fs.open_input_stream(src) as f, create(dst) as out:
            while chunk := f.read(COPY_CHUNK):
                h.update(chunk)
                out.write(chunk)
                copied += len(chunk)
            out.flush()
            os.fsync(out.fileno())
    except OSError as e:
        raise DataError(f"copying {where} to this node failed: {e}") from None
    if size is not None and copied != size:
        raise DataError(_size_message(where, copied, size))
    if h.hexdigest() != sha:
        raise DataError(_hash_mismatch(where, h.hexdigest(), sha))
