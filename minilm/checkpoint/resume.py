"""Which checkpoint a run continues, and who may write its folder: `RunFolder` (any storage, through pyarrow), its
`Lease` (one live run) and `decide_resume` (--resume, applied under the lease); the rules every entry point follows."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow.fs as pafs

from ..config import ModelConfig, from_bool
from ..errors import UsageError
from ..fsio import fsync_dir, loads, pid_alive, write_atomic
from .files import MARKER, CheckpointError, parse_marker, parse_state, read_state, verify

LEASE = "lease.json"
CHECKPOINT_NAME = re.compile(r"checkpoint_\d{8}(_\d+)?")  # not Ray's checkpoint_manager_snapshot.json
LEASE_HEARTBEAT_S, LEASE_STALE_S = 10.0, 60.0


class RunFolder:
    """STORAGE/NAME on a local or pyarrow filesystem. `download(fs_path)` is a context manager giving a local copy of a
    remote folder (Ray's, shared by a node's ranks); without one, remote checkpoints are checked but not loaded."""

    def __init__(self, location: str | os.PathLike, filesystem: pafs.FileSystem | None = None, download=None,
                 display: str | None = None):
        location = str(location)
        if filesystem is None and "://" in location:
            filesystem, location = pafs.FileSystem.from_uri(location)
        elif filesystem is None:
            filesystem, location = pafs.LocalFileSystem(), str(Path(location).expanduser().resolve())
        self.fs, self.root, self.download = filesystem, location.rstrip("/"), download
        self.local = Path(self.root) if isinstance(filesystem, pafs.LocalFileSystem) else None
        self.display = display or self.root

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def names(self) -> list[str]:
        return sorted(i.base_name for i in self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True)))

    def checkpoints(self) -> list[str]:
        """The checkpoint folders, oldest first (a step redone after a fall-back sorts after: checkpoint_<step>_<k>)."""
        return [n for n in self.names() if CHECKPOINT_NAME.fullmatch(n)]

    def read(self, rel: str) -> bytes | None:
        try:
            with self.fs.open_input_stream(self._path(rel)) as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError):
            return None

    def write(self, rel: str, data: bytes) -> None:
        if self.local is not None:  # atomic, readable by owner and group
            self.local.mkdir(mode=0o750, parents=True, exist_ok=True)
            return write_atomic(self.local / rel, data, mode=0o640)
        with self.fs.open_output_stream(self._path(rel)) as f:
            f.write(data)

    def delete(self, rel: str) -> None:
        if self.local is not None and (self.local / rel).is_dir():
            return shutil.rmtree(self.local / rel)
        kind = self.fs.get_file_info(self._path(rel)).type
        if kind != pafs.FileType.NotFound:
            (self.fs.delete_dir if kind == pafs.FileType.Directory else self.fs.delete_file)(self._path(rel))

    def next_name(self, step: int) -> str:
        """checkpoint_<step>, or checkpoint_<step>_<k> when that exists (a step redone after a fall-back)."""
        return _free(f"checkpoint_{step:08d}", "_", self.checkpoints())

    def complete(self, name: str, once_per_node: bool = False) -> None:
        """CheckpointError unless `name` is complete: hashed when local, every file there on object storage."""
        if self.local is not None:
            return verify(self.local / name, once_per_node)
        files = parse_marker(self.read(f"{name}/{MARKER}"), f"{self.display}/{name}")
        infos = self.fs.get_file_info([self._path(f"{name}/{f}") for f in files])
        missing = [i.base_name for i in infos if i.type != pafs.FileType.File]
        if missing:
            raise CheckpointError(f"checkpoint {self.display}/{name} is incomplete: {missing[0]} is missing")

    def newest_complete(self, say=print) -> str | None:
        """The newest complete checkpoint; says what it skips."""
        for name in reversed(self.checkpoints()):
            try:
                self.complete(name, once_per_node=True)
                return name
            except CheckpointError as e:
                say(f"skipping checkpoint: {e}")
        return None

    @contextlib.contextmanager
    def local_copy(self, name: str):
        if self.local is not None:
            yield self.local / name
            return
        if self.download is None:
            raise CheckpointError(f"checkpoint {self.display}/{name} is on remote storage: load it in a Ray worker")
        with self.download(self._path(name)) as path:
            yield Path(path)

    def sync(self, name: str) -> None:
        """Local storage: fsync every file of a checkpoint written by another writer (Ray's copy), then its folders."""
        if self.local is None:
            return
        for folder, _, files in os.walk(self.local / name):
            for f in [*files, "."]:  # fsync_dir takes a file too
                fsync_dir(Path(folder) / f)
        fsync_dir(self.local)

    def move_aside(self, names: list[str], copies: tuple[str, ...] = ()) -> str:
        """Move `names` (and copy `copies`) into abandoned-<time>/: nothing is deleted, nothing is continued."""
        # a second start within the same second: its own folder
        dest = _free(f"abandoned-{time.strftime('%Y%m%d-%H%M%S')}", "-", self.names())
        self.fs.create_dir(self._path(dest))
        for rel in copies:
            if self.fs.get_file_info(self._path(rel)).type == pafs.FileType.File:
                self.fs.copy_file(self._path(rel), self._path(f"{dest}/{rel}"))
        for rel in names:
            if self.local is not None:
                os.replace(self.local / rel, self.local / dest / rel)
            else:  # object storage has no rename of a folder
                pafs.copy_files(self._path(rel), self._path(f"{dest}/{rel}"), self.fs, self.fs)
                self.delete(rel)
        return f"{self.display}/{dest}"

    def has_marker(self, name: str) -> bool:
        with contextlib.suppress(CheckpointError, OSError):
            return bool(parse_marker(self.read(f"{name}/{MARKER}"), name))
        return False


def _free(name: str, sep: str, taken: list[str]) -> str:
    """`name`, else `name<sep>1`, `name<sep>2`, ...: the first not in `taken`."""
    return next(n for k in itertools.count() if (n := f"{name}{sep}{k}" if k else name) not in taken)


# ---- one live run per folder ----------------------------------------------------------------------

class Lease:
    """The run folder's `lease.json`: which process runs in it (host, pid, heartbeat every LEASE_HEARTBEAT_S). A lease
    whose heartbeat is older than LEASE_STALE_S, or whose process on this host is gone, is taken over with a note."""

    def __init__(self, folder: RunFolder, say=print):
        self.folder, self.say = folder, say
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self) -> Lease:
        local = self.folder.local
        self.created = [p for p in (local, *local.parents) if not p.exists()] if local is not None else []
        self.check()
        try:
            self._beat()
        except OSError as e:
            self.release()
            raise self.unwritable(e.strerror or str(e)) from None
        self._thread = threading.Thread(target=self._heartbeat, name="minilm-lease", daemon=True)
        self._thread.start()
        return self

    def check(self, writable: bool = False) -> None:
        """Refuse a folder a live run holds (a note for one whose run is gone), reading only; `writable`: also a local
        folder that could not be made or written (what taking the lease would find out by writing)."""
        held = self.holder()
        if held is not None and not self.mine(held):
            who = f"pid {held['pid']} on {held['host']}, heartbeat {time.time() - held['heartbeat']:.0f} s ago"
            if self.live(held):
                raise UsageError(f"run folder {self.folder.display} is in use by a live run ({who}): wait for it to "
                                 f"end (or stop it), or use another --run-dir")
            self.say(f"note: taking over run folder {self.folder.display} from a run that is gone ({who})")
        local = self.folder.local
        if writable and local is not None:
            nearest = next(p for p in (local, *local.parents) if p.exists())
            if not nearest.is_dir() or not os.access(nearest, os.W_OK | os.X_OK):
                raise self.unwritable(f"{nearest} is not a folder" if not nearest.is_dir() else "Permission denied")

    def unwritable(self, why: str) -> UsageError:
        return UsageError(f"run folder {self.folder.display}: cannot create or write there ({why}); choose a writable "
                          f"folder (--run-dir) or an s3:// / gs:// URI")

    def live(self, held: dict | None = None) -> bool:
        """Another process runs in the folder (`held`: its lease, else read now)."""
        held = self.holder() if held is None else held
        if held is None or self.mine(held):
            return False
        fresh = time.time() - held["heartbeat"] < LEASE_STALE_S
        return fresh and (held["host"] != self.me["host"] or pid_alive(held["pid"]))

    def mine(self, held: dict) -> bool:
        return (held.get("host"), held.get("pid")) == (self.me["host"], self.me["pid"])

    def holder(self) -> dict | None:
        try:
            held = loads(self.folder.read(LEASE) or b"null")
        except (ValueError, OSError):
            return None
        # a lease another party wrote is trusted by type only: a host, a pid and a finite heartbeat, else none is held
        ok = isinstance(held, dict) and isinstance(held.get("host"), str) and type(held.get("pid")) is int and \
            type(held.get("heartbeat")) in (int, float) and math.isfinite(held["heartbeat"])
        return held if ok else None

    def _beat(self) -> None:
        self.folder.write(LEASE, json.dumps({**self.me, "heartbeat": time.time()}).encode())

    def _heartbeat(self) -> None:
        while not self._stop.wait(LEASE_HEARTBEAT_S):
            with contextlib.suppress(OSError):
                self._beat()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.mine(self.holder() or {}):
            with contextlib.suppress(OSError):
                self.folder.delete(LEASE)
        for folder in self.created:  # a run refused before it wrote anything leaves no folder behind
            try:
                folder.rmdir()
            except OSError:
                break


# ---- --resume ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ResumeDecision:
    """What --resume does to a run folder, decided before anything is touched (`decide_resume`) and carried out only
    once every check of the run has passed (`apply`)."""

    origin: str | None  # the checkpoint a fresh start continues (a path), or None
    abandon: tuple[str, ...] = ()  # moved into abandoned-<time>/ by --abandon-newer
    copies: tuple[str, ...] = ()  # copied there (a rollback keeps the logs it continues)
    listed: str = ""
    start: str = ""

    def apply(self, folder: RunFolder | None, say=print) -> None:
        if self.abandon:
            dest = folder.move_aside(list(self.abandon), copies=self.copies)
            say(f"note: --abandon-newer: moved {self.listed} into {dest}; {self.start} continues in {folder.display}")


# The run's logs and evaluation state belong to the branch that wrote them: a fresh start moves them aside with it.
BRANCH_LOGS = ("metrics.jsonl", "world_size.csv", "last_optimizer_step", "eval.jsonl", "best.json",
               "eval-pending.json", "config.yaml")


def decide_resume(folder: RunFolder | None, resume: str, abandon_newer: bool = False) -> ResumeDecision:
    """--resume auto|never|PATH against what the run folder holds (under its lease), read only. Starting fresh, or from
    a checkpoint older than others of the folder, would leave a branch that pruning and `auto` mix with the new one:
    refused, unless `abandon_newer`, whose move (and, starting fresh, the run's logs') `apply` makes."""
    if resume == "auto":  # (what it passes over, the loading process says)
        return ResumeDecision(folder.newest_complete(lambda _: None) if folder is not None else None)
    names = folder.checkpoints() if folder is not None else []
    origin = None
    if resume != "never":
        path = Path(resume).expanduser().resolve()
        verify(path, once_per_node=True)  # missing, partial or corrupt: refused before any work starts
        origin = str(path)
        if folder is not None and path.parent == folder.local:
            names = [n for n in names if n > path.name]
    if not names:
        return ResumeDecision(origin)
    listed = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    start = "a fresh run" if origin is None else f"a run from {origin}"
    if not abandon_newer:
        raise UsageError(f"run folder {folder.display} already holds checkpoint(s) {listed}, which {start} would mix "
                         f"with its own: continue them with --resume auto, add --abandon-newer to move them into "
                         f"{folder.display}/abandoned-<time>/, or use another --run-dir")
    logs = tuple(n for n in BRANCH_LOGS if n in folder.names())
    fresh = origin is None
    return ResumeDecision(origin, tuple(names) + (logs if fresh else ()), () if fresh else logs, listed, start)


# ---- what may change across a resume ---------------------------------------------------------------

# Train-config fields added after checkpoints were first written, and the value every checkpoint that lacks one ran
# with: a resume continues that value (Trainer.restore), whatever today's default is.
PREDATED_VALUES = {"schedule": "cosine", "embedding_lr_ratio": 1.0}
# Fields a resume may change without changing the optimisation; any other needs --allow-config-change.
SAFE_TO_CHANGE = frozenset({"log_every", "checkpoint_every", "checkpoint_every_minutes", "checkpoint_mode",
                            "export_every", "compile", "activation_checkpointing", "micro_batch_size",
                            "max_nonfinite_steps", "eval_every"})
# Never changed: the global batch and the seed fix the data order, the optimizer kind its state.
FIXED = {"global_batch_size": " (the global batch is the invariant of a run)", "seed": "",
         "optimizer": " (its state has no counterpart in the other optimizer): continue it with --optimizer {was}"}


class ConfigChange(NamedTuple):
    name: str
    before: Any
    after: Any
    safe: bool

    def __str__(self) -> str:
        return f"{self.name} {self.before} -> {self.after}"


def checkpoint_dtype(state: dict[str, Any]) -> str | None:
    """The precision a checkpoint's run trained in (None for one that left it at auto)."""
    dtype = state.get("train_config", {}).get("dtype")
    return None if dtype in (None, "auto") else dtype


def resumed_dtype(requested: str, state: dict[str, Any] | None) -> str:
    """--dtype of a run that continues `state` (None: a fresh start): `auto` keeps the checkpoint's precision."""
    saved = checkpoint_dtype(state) if state else None
    return saved if requested == "auto" and saved else requested


def config_changes(state: dict[str, Any], train_config) -> list[ConfigChange]:
    """What a resumed run changes against the checkpoint's train config (the FIXED fields, and those inert in this
    config, aside: the optimizer is FIXED, so a field inert here was inert in the checkpoint's run too)."""
    saved, changes = state.get("train_config", {}), []
    for name, after in sorted(train_config.to_dict().items()):
        before = checkpoint_dtype(state) if name == "dtype" else from_bool(name, saved.get(name, after))
        if name == "dtype" and (after == "auto" or before is None):
            continue  # the checkpoint's precision goes on
        if name not in FIXED and name not in train_config.inert() and before != after:
            changes.append(ConfigChange(name, before, after, name in SAFE_TO_CHANGE))
    return changes


def check_resume(state: dict[str, Any], where, model_config: ModelConfig, train_config, data_fingerprint: str,
                 allow_config_change: bool) -> list[ConfigChange]:
    """Refuse (one CheckpointError line) a resume that cannot work or would silently change the run; the changes
    it makes (safe ones, and with `allow_config_change` the others)."""
    problems, before, dtype = [], checkpoint_dtype(state), train_config.dtype
    if dtype != "auto" and before and dtype != before and "fp16" in (dtype, before):
        problems.append(f"dtype {dtype} != {before} in the checkpoint (fp16's GradScaler state has no counterpart "
                        f"in bf16 or fp32; only fp32 <-> bf16 can change mid-run, with --allow-config-change)")
    for name, why in FIXED.items():
        was = state["global_batch_size"] if name == "global_batch_size" else state["train_config"].get(name, "adamw")
        if was != getattr(train_config, name):
            problems.append(f"{name} {getattr(train_config, name)} != {was} in the checkpoint" + why.format(was=was))
    # A field added to ModelConfig since the checkpoint was written (e.g. document_mask) has its default there.
    saved_model = {**ModelConfig().to_dict(), **state["model_config"]}
    if saved_model != model_config.to_dict():
        changed = sorted(f"{k} {v} != {saved_model.get(k)}" for k, v in model_config.to_dict().items()
                         if saved_model.get(k) != v)
        problems.append(f"the model config differs from the checkpoint's ({', '.join(changed)})")
    if state["data_fingerprint"] != data_fingerprint:
        problems.append(f"the data fingerprint {data_fingerprint[:12]} differs from the checkpoint's "
                        f"{state['data_fingerprint'][:12]} (other --data, or data made with another tokenizer)")
    if problems:
        raise CheckpointError(f"cannot resume from {where}: " + "; ".join(problems) + " (use another --run-dir to "
                              "start a new run)")
    changes = config_changes(state, train_config)
    refused = [c for c in changes if not c.safe]
    if refused and not allow_config_change:
        raise CheckpointError(f"cannot resume from {where} with other settings: " + "; ".join(map(str, refused)) +
                              " change the schedule or optimizer mid-run; pass --allow-config-change to continue "
                              "with the new values, or use another --run-dir")
    return changes


def check_origin(folder: RunFolder | None, origin: str | None, model_config: ModelConfig, train_config,
                 data_fingerprint: str, allow_config_change: bool, say=print) -> dict[str, Any] | None:
    """The state.json of the checkpoint a fresh start continues, `check_resume`d with a note for each change;
    --optimizer auto becomes the checkpoint's optimizer."""
    if origin is None:
        return None
    # a checkpoint anywhere on this machine (a path), or of the run folder (a name)
    state = read_state(origin) if "/" in origin else \
        parse_state(folder.read(f"{origin}/state.json") or b"", f"{folder.display}/{origin}")
    if train_config.optimizer == "auto":  # the checkpoint's, untimed: its optimizer state fits that optimizer only
        train_config.optimizer = state["train_config"].get("optimizer", "adamw")  # no field: before Muon
    for c in check_resume(state, origin, model_config, train_config, data_fingerprint, allow_config_change):
        say(f"note: resuming with {c}" + ("" if c.safe else " (--allow-config-change)"))
    return state


__all__ = ["LEASE", "PREDATED_VALUES", "ConfigChange", "Lease", "ResumeDecision", "RunFolder", "decide_resume",
           "check_origin", "check_resume", "checkpoint_dtype", "config_changes", "resumed_dtype"]
