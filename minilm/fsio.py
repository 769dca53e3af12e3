"""The file-system layer every writer goes through (imports nothing of minilm): atomic files, staged folders, per-node
stamps, fsync, the one JSONL reader and appender. Files and staging folders are created exclusively, never through
a link someone planted."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
STAGING = ".minilm-staging-"  # + host-pid-what: a folder being written, swept once its process is gone
RACY_NS = 2_000_000_000  # a file modified this recently when hashed is not vouched for: hashed again next time


def loads(raw: str | bytes):
    """json.loads for a file another party may have written: nesting too deep for the parser is bad JSON too."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


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
        except (ValueError, KeyError, TypeError):  # `loads` makes nesting past the stack a ValueError
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


def create(path: str | os.PathLike, mode: int = 0o666, buffering: int = -1):
    """`path` opened for writing as a new file; FileExistsError if anything is there already, a link included."""
    return open(os.open(path, NEW_FILE, mode), "wb", buffering=buffering)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a folder (or file) by name, so that what was renamed or created in it survives a crash; best effort."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: str | os.PathLike, data: bytes | str, mode: int = 0o666) -> None:
    """`data` (text as UTF-8) in a new file beside `path`, fsynced and renamed over it, then the folder fsynced:
    `path` is the old file or the new one, never half of one, whatever kills the process or the machine."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        with create(tmp, mode) as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def pid_alive(pid: int) -> bool:
    """Is process `pid` of this host alive (staging and leases of a process that is gone may be taken)?"""
    if not 0 < pid <= 1 << 22:  # Linux's largest pid_max; 0 and -1 would ask about a whole process group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def staging_dir(root: Path, what: str, pid: int | None = None) -> Path:
    """Where this process (or `pid`) stages `what` under `root`, named for its host and process for `sweep_staging`."""
    return Path(root) / f"{STAGING}{socket.gethostname()}-{pid or os.getpid()}-{what}"


def sweep_staging(root: Path) -> list[Path]:
    """Remove the staging folders under `root` left by processes of this host that are gone (a crash mid-write)."""
    swept, mine = [], re.compile(re.escape(f"{STAGING}{socket.gethostname()}-") + r"(\d+)-.*")
    for p in root.glob(f"{STAGING}*") if root.is_dir() else []:
        if (m := mine.fullmatch(p.name)) and not pid_alive(int(m[1])):
            shutil.rmtree(p, ignore_errors=True)  # a link is not followed: rmtree refuses one
            swept.append(p)
    return swept


@contextlib.contextmanager
def staged(final: Path) -> Iterator[Path]:
    """The staging folder of `final`, beside it (`publish` is a rename), after a sweep; its writer creates it with mkdir,
    never exist_ok (a planted folder or link is refused); removed on the way out unless published."""
    final.parent.mkdir(parents=True, exist_ok=True)
    sweep_staging(final.parent)
    path = staging_dir(final.parent, final.name)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)  # a link is not followed: rmtree refuses one


def publish(staged_path: Path, final: Path, replace: bool = False) -> Path:
    """Rename the finished `staged_path` to `final` (fsynced before, `final`'s folder after); an earlier output there
    is moved aside and removed (`replace`), else only an empty folder is (`rmdir` refuses any other)."""
    fsync_dir(staged_path)
    old = staging_dir(final.parent, f"{final.name}-old") if replace and final.exists() else None
    if old is not None:
        os.replace(final, old)
    elif final.exists():
        final.rmdir()
    try:
        os.replace(staged_path, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)  # the earlier output stays where it was
        raise
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def private_folder(path: Path) -> Path:
    """`path` as a folder only this user may enter (0700); if another user made it, or a link, a new mkdtemp folder."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=True)
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
        return path
    return Path(tempfile.mkdtemp(prefix=f"{path.name}-", dir=path.parent))


@contextlib.contextmanager
def node_lock(lock_path: Path) -> Iterator[None]:
    """An exclusive lock between the processes of this node (the ranks and read tasks of a run)."""
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


def file_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


class NodeStamp:
    """What a node's processes found hashing `folder`'s files, per file keyed by its size, mtime and inode, under a
    shared lock; as in git's index, a file modified under RACY_NS before it was hashed is not vouched for."""

    def __init__(self, root: Path, folder: Path, fingerprint: str):
        self.folder, self.fingerprint = folder, fingerprint
        self.path = root / f"{hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:32]}.json"
        self.keys: dict[str, list[int]] = {}
        self.entries: dict[str, list] = {}

    def __enter__(self) -> NodeStamp:
        self._lock = node_lock(self.path.with_suffix(".lock"))
        self._lock.__enter__()
        try:
            saved = loads(self.path.read_text())
        except (OSError, ValueError):
            saved = None
        ours = isinstance(saved, dict) and saved.get("fingerprint") == self.fingerprint
        self.saved = saved["files"] if ours and isinstance(saved.get("files"), dict) else {}
        return self

    def known(self, name: str) -> list:
        """What was found for the file `name` when it had the size, mtime and inode it has now ([] if nothing)."""
        key = self.keys[name] = file_key(self.folder / name)
        entry = self.saved.get(name)
        return entry[3:] if isinstance(entry, list) and entry[:3] == key else []

    def vouch(self, name: str, *found) -> None:
        """Record what was found for `name` (its key from `known`, taken before hashing) unless it is too fresh."""
        key = self.keys.get(name) or file_key(self.folder / name)
        if key[1] <= time.time_ns() - RACY_NS:
            self.entries[name] = [*key, *found]

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None and self.entries != self.saved:
                with contextlib.suppress(OSError):  # no writable cache: the next process hashes again
                    write_atomic(self.path, json.dumps({"path": str(self.folder.resolve()),
                                                        "fingerprint": self.fingerprint, "files": self.entries}))
                    self._prune()
        finally:
            self._lock.__exit__(None, None, None)

    def _prune(self) -> None:
        for p in self.path.parent.glob("*.json"):
            try:
                if not Path(loads(p.read_text())["path"]).exists():
                    p.unlink()
                    p.with_suffix(".lock").unlink(missing_ok=True)
            except (OSError, ValueError, KeyError, TypeError):
                continue
