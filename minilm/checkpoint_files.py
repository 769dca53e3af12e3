"""How a checkpoint folder is written: each file hashed as it goes to disk, COMPLETE.json last.

Hashing on the way means the marker needs no second read of the files; writing it last means a
folder without it was never finished, so `minilm.checkpoint.verify` refuses it.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from .data import file_sha256

MARKER = "COMPLETE.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the folder and the file."""


def write_files(path: Path, writers: dict[str, Callable[[Path], str]], step: int | None, hooks=None, *,
                via_tmp: bool = False) -> None:
    """Write each file of the folder `path` (a writer returns the file's SHA-256), then the marker.

    With `via_tmp` the files go to `path.tmp`, which replaces `path` once complete. A failed write
    raises one CheckpointError line naming the step, the folder and the file, and leaves no marker
    (and no `path.tmp`, so a full disk gets its space back). `hooks` is for the fault tests only.
    """
    folder = path.with_name(path.name + ".tmp") if via_tmp else path
    if via_tmp:
        shutil.rmtree(folder, ignore_errors=True)
    name = folder.name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        digests = {}
        for name, write in writers.items():
            if hooks:
                hooks.before_checkpoint_file(step, name)
            digests[name] = write(folder / name)
        name = MARKER
        if hooks:
            hooks.before_marker(folder, step)
        write_marker(folder, list(digests), digests)
        if via_tmp:
            shutil.rmtree(path, ignore_errors=True)
            os.replace(folder, path)
    except (OSError, SafetensorError) as e:
        if via_tmp:
            shutil.rmtree(folder, ignore_errors=True)
        raise CheckpointError(write_error(folder, step, name, e)) from None


def write_marker(path: Path, files: tuple[str, ...] | list[str], digests: dict[str, str] | None = None) -> None:
    """COMPLETE.json naming `files` with their SHA-256 (`digests`, taken as they were written; else read here)."""
    marker = {"files": {name: (digests or {}).get(name) or file_sha256(path / name) for name in files}}
    tmp = path / (MARKER + ".tmp")
    tmp.write_text(json.dumps(marker, indent=2, sort_keys=True))
    os.replace(tmp, path / MARKER)  # atomic: the marker appears whole or not at all


def is_disk_full(e: BaseException) -> bool:
    """ENOSPC or EDQUOT, also when safetensors or pyarrow (Ray's checkpoint upload) say it only in the message."""
    return getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "no space left on device" in str(e).lower()


def write_error(path: Path | str, step: int | None, name: str, e: BaseException) -> str:
    """One line: which checkpoint could not be written where, why, and what is left intact."""
    why = "no space left on device" if is_disk_full(e) else (getattr(e, "strerror", None) or str(e) or type(e).__name__)
    if step is None:
        return f"could not write {path} ({name}): {why}; free space (or fix the storage) and try again"
    return (f"could not write the checkpoint of optimizer step {step} to {path} ({name}): {why}; earlier "
            f"checkpoints are intact: free space (or fix the storage), then continue with --resume auto")


class _HashingFile(io.RawIOBase):
    """A file that hashes the bytes written through it and keeps the OSError of a failed write.

    torch's C++ writer turns ENOSPC into an opaque RuntimeError, so the caller raises the kept error instead.
    """

    def __init__(self, raw):
        self.raw, self.error, self.sha256 = raw, None, hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        done = 0
        try:
            while done < len(view):
                done += self.raw.write(view[done:])
        except OSError as e:
            self.error = e
            raise
        self.sha256.update(view)
        return done


def torch_save(obj, f: Path) -> str:
    """torch.save into `f`; its SHA-256."""
    with open(f, "wb", buffering=0) as raw:
        out = _HashingFile(raw)
        try:
            torch.save(obj, out)
        except RuntimeError:
            if out.error is not None:
                raise out.error from None
            raise
        return out.sha256.hexdigest()


def write_bytes(f: Path, payload: bytes) -> str:
    with open(f, "wb", buffering=0) as raw:
        out = _HashingFile(raw)
        out.write(payload)
        return out.sha256.hexdigest()


# safetensors lays the tensors out by dtype (this order, widest first), then by name.
_SAFETENSORS_DTYPES = {torch.int64: "I64", torch.float64: "F64", torch.float32: "F32", torch.int32: "I32",
                       torch.bfloat16: "BF16", torch.float16: "F16", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}
_DTYPE_RANK = {name: rank for rank, name in enumerate(_SAFETENSORS_DTYPES.values())}


def write_safetensors(f: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """The file `safetensors.torch.save_file` writes, streamed from the CPU tensors' own memory; its SHA-256.

    Without metadata it is the same byte for byte; metadata keys go in sorted order, since safetensors'
    own order is a hash map's.
    """
    order = sorted(tensors, key=lambda k: (_DTYPE_RANK[_SAFETENSORS_DTYPES[tensors[k].dtype]], k))
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    for k in order:
        t = tensors[k]
        end = offset + t.numel() * t.element_size()
        header[k] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(f, "wb", buffering=0) as raw:
        out = _HashingFile(raw)
        out.write(struct.pack("<Q", len(text)) + text)
        for k in order:
            t = tensors[k]
            if t.numel():
                out.write(t.detach().contiguous().view(-1).view(torch.uint8).numpy())
        return out.sha256.hexdigest()
