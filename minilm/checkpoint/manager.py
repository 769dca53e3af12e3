"""The one owner of a run's checkpoints: when to save, where it is staged, how it is written, published, verified,
pruned, and which one a (re)start loads. The loop only copies the state into reused host buffers (`StateSnapshot`);
a writer thread does the rest, one save in flight at a time, so the buffers are never overwritten while read."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ..config import ModelConfig, TrainConfig
from ..fsio import publish, staging_dir, sweep_staging
from . import files as F
from .best import pinned, scored_checkpoints
from .resume import RunFolder


class Cadence:
    """When to checkpoint: every `every` steps, when `minutes` passed since the last one (rank 0's clock raises a flag
    that every rank agrees on `delay` steps later), and at the run's last step."""

    def __init__(self, every: int, minutes: float | None = None, rank0: bool = True, clock=time.monotonic):
        self.every, self.clock = every, clock
        self.seconds = 60 * minutes if minutes and rank0 else None
        self.last_step, self.since, self.raised = 0, clock(), False

    def time_due(self) -> bool:
        """Raised once until the next checkpoint; called every step, so cheap."""
        if self.seconds is None or self.raised:
            return False
        self.raised = self.clock() - self.since >= self.seconds
        return self.raised

    def due(self, step: int, final: bool, time_flag: bool, delay: int) -> bool:
        # a time flag raised `delay` steps ago counts unless a checkpoint was written since
        if final or step % self.every == 0 or (time_flag and self.last_step < step - delay):
            self.last_step, self.since, self.raised = step, self.clock(), False
            return True
        return False


class StateSnapshot:
    """Host copies of the training state, in buffers reused from one snapshot to the next. On CUDA the buffers are
    pinned and filled with non-blocking copies on the current stream, complete at an event the writer waits on."""

    def __init__(self, device: torch.device | str):
        self.pinned = torch.device(device).type == "cuda" and torch.cuda.is_available()
        self.buffers: dict[str, torch.Tensor] = {}

    def _copy(self, key: str, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            buf = self.buffers.get(key)
            if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
                buf = self.buffers[key] = torch.empty(obj.shape, dtype=obj.dtype, device="cpu", pin_memory=self.pinned)
            return buf.copy_(obj.detach(), non_blocking=self.pinned)
        if isinstance(obj, dict):
            return {k: self._copy(f"{key}/{k}", v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(f"{key}/{i}", v) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def take(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler, state: dict,
             live: bool = False) -> F.ResumeState:
        """The state as of now, in this object's buffers (valid until the next `take`), or with `live` (sync mode)
        the state itself; `state`: state.json's content."""
        if live:
            return F.ResumeState(F.model_tensors(model.state_dict()), optimizer.state_dict(), scaler.state_dict(), state)
        snap = F.ResumeState(self._copy("model", dict(model.state_dict())), self._copy("optimizer", optimizer.state_dict()),
                             copy.deepcopy(scaler.state_dict()), state)
        if self.pinned:
            snap.event = torch.cuda.Event()
            snap.event.record()
        return snap


@dataclass(frozen=True)
class WeightsExport:
    """The half-precision weights export written into `<checkpoint>/weights` with a checkpoint."""

    config: ModelConfig
    tokenizer_path: Path | None = None


class PendingSave:
    """A checkpoint being written into its staging folder: `wait()` for it (raises its error, its publication's
    included); the storage calls `published(name)` once it is in the run folder."""

    def __init__(self, path: Path, step: int, blocking: bool, on_published: Callable[[str], None]):
        self.path, self.step, self.blocking, self.published = Path(path), step, blocking, on_published
        self.error: BaseException | None = None
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def failed(self) -> bool:
        return self.done() and self.error is not None

    def wait(self) -> Path:
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.path

    def finish(self, error: BaseException | None) -> None:
        self.error = error
        self._done.set()


class Storage(Protocol):
    """What a launcher provides: where the run's checkpoints go (`LocalStorage`, ray_jobs/worker.py's `RayStorage`)."""

    folder: RunFolder | None  # the run folder; None: no checkpoint is kept
    staging: Path  # this node's root for staging folders (on the run folder's filesystem for a rename)

    def report(self, metrics: dict, save: PendingSave | None) -> None:
        """Every rank at every log step; rank 0's save is published once complete, then `save.published(name)`."""

    def written(self, save: PendingSave) -> None:
        """On rank 0's writer thread, once `save` is complete: publish it now, or leave it to `report`."""


class LocalStorage:
    """A local run folder: a complete checkpoint is renamed into it by its writer; metrics go nowhere else."""

    def __init__(self, run_dir: str | os.PathLike | None):
        self.folder = RunFolder(str(run_dir)) if run_dir else None
        self.staging = Path(run_dir) if run_dir else Path(".")

    def report(self, metrics: dict, save: PendingSave | None) -> None:
        """Nothing: metrics go nowhere else, and `written` publishes a save."""

    def written(self, save: PendingSave) -> None:
        save.published(publish(save.path, self.folder.local / self.folder.next_name(save.step)).name)


class CheckpointManager:
    """Every rank reports through it at every log step; rank 0 writes. The last save, and every sync-mode save, is
    complete and published when `report` returns; `failed()` says (cheaply) that a background save failed."""

    def __init__(self, storage: Storage, cfg: TrainConfig, *, rank: int, device: torch.device, keep: int = 3,
                 origin: str | None = None, export: WeightsExport | None = None, hooks=None, say=print,
                 keep_unscored: bool = False):
        self.storage, self.folder, self.rank, self.say = storage, storage.folder, rank, say
        self.keep_unscored = keep_unscored  # checkpoints scored beside training: none pruned before its scores
        self.keep, self.origin, self.export, self.hooks = keep, origin, export, hooks
        self.mode, self.export_every = cfg.checkpoint_mode, cfg.export_every
        self.cadence = Cadence(cfg.checkpoint_every, cfg.checkpoint_every_minutes, rank == 0)
        self.snapshot = StateSnapshot(device) if rank == 0 else None
        self.pending: PendingSave | None = None
        self._thread: threading.Thread | None = None
        self.index = 0  # checkpoints written by the run so far (the export cadence counts them)
        self.save_s = self.wait_s = 0.0  # the last save's cost to the loop: its snapshot, and the wait before it
        self.resumed_from: str | None = None
        if self.folder is not None:
            for path in sweep_staging(storage.staging):
                say(f"note: removed {path.name}, a checkpoint left half-written by a process that is gone")

    def load(self) -> F.ResumeState | None:
        """The newest complete checkpoint of the run folder, else the one the entry point chose (`origin`), else None;
        verified (its hashes read once per node) and loaded, passing over torn or corrupt ones with a message."""
        names = list(reversed(self.folder.checkpoints())) if self.folder is not None else []
        for name in names + ([self.origin] if self.origin and self.origin not in names else []):
            try:
                with (self.folder.local_copy(name) if name in names else contextlib.nullcontext(Path(name))) as path:
                    state = F.load_resume_state(path, keys=F.STATE_KEYS, once_per_node=True)
                    self.resumed_from = name
                    return state
            except F.CheckpointError as e:
                if name not in names:
                    raise
                self.say(f"skipping checkpoint: {e}")
        return None

    def report(self, step: int, metrics: dict, *, model=None, optimizer=None, scaler=None, state: dict | None = None,
               final: bool = False) -> None:
        """Every rank, at each log step: the metrics, and with `state` (a checkpoint step: state.json's content) rank 0
        writes a checkpoint of model, optimizer and scaler into a staging folder and hands it to the storage."""
        if state is None:
            return self.storage.report(metrics, None)
        t0 = time.perf_counter()
        wait_s = self.wait()  # raises the previous save's error
        self.index += 1
        save = None
        if self.rank == 0 and self.folder is not None:
            exporting = final or self.index % self.export_every == 0
            save = self._start(step, model, optimizer, scaler, {**state, "checkpoint_index": self.index},
                               self.export if exporting else None, blocking=final or self.mode == "sync")
        if save is not None and save.blocking:
            save.wait()  # complete before the storage publishes it
        self.storage.report(metrics, save)
        if save is not None and save.blocking:
            save.wait()  # published
        self.wait_s, self.save_s = wait_s, time.perf_counter() - t0 - wait_s

    def _start(self, step, model, optimizer, scaler, state, export, blocking) -> PendingSave:
        snap = self.snapshot.take(model, optimizer, scaler, state, live=blocking)
        path = staging_dir(self.storage.staging, f"{step:08d}")
        if path.exists():  # this process's own failed save of the step (rmtree refuses a link)
            shutil.rmtree(path, ignore_errors=True)
        save = PendingSave(path, step, blocking, self.published)
        self._thread = threading.Thread(target=self._write, args=(save, snap, export),
                                        name=f"minilm-checkpoint-writer-{step}", daemon=True)
        self.pending = save
        self._thread.start()
        return save

    def _write(self, save: PendingSave, snap: F.ResumeState, export: WeightsExport | None) -> None:
        error = None
        try:
            if snap.event is not None:
                snap.event.synchronize()
            F.write_resume_state(save.path, snap, self.hooks)
            if export is not None:
                F.write_weights_export(save.path / "weights", snap.model_state, export.config, export.tokenizer_path,
                                       step=save.step, in_place=True)
            self.storage.written(save)
        except BaseException as e:  # a failed write or publication: handed to whoever waits for this save
            error = e
        save.finish(error)

    def published(self, name: str) -> None:
        """The storage has put checkpoint `name` in the run folder: make it durable, check it, then prune."""
        self.folder.sync(name)
        self.folder.complete(name)
        self.prune(name)

    def prune(self, newest: str) -> list[str]:
        """Keep `newest` and the `keep - 1` complete checkpoints before it; delete older ones and torn folders, never
        the checkpoint this run resumed from, a `pinned` one (with `keep_unscored`, also any not yet scored) nor
        anything newer. A failed delete, or a best.json that cannot be read (nothing is deleted), is a warning."""
        try:
            pins = pinned(self.folder)
            if self.keep_unscored and self.folder.local is not None:
                pins |= set(self.folder.checkpoints()) - scored_checkpoints(self.folder)
        except (F.CheckpointError, OSError) as e:
            self.say(f"warning: not pruning old checkpoints: {e}")
            return []
        names = [n for n in self.folder.checkpoints() if n <= newest]
        kept = [n for n in names if n == newest or self.folder.has_marker(n)][-self.keep:]
        removed = []
        for name in names:
            if name >= kept[0] or name in pins or name == (self.origin and Path(self.origin).name):
                continue
            try:
                self.folder.delete(name)
                removed.append(name)
            except OSError as e:
                self.say(f"warning: could not delete old checkpoint {self.folder.display}/{name} (--keep-checkpoints "
                         f"{self.keep}): {e.strerror or e}; it stays on disk, and the run goes on")
        return removed

    def wait(self) -> float:
        """Wait for the save in flight (raising its error); the seconds waited."""
        t0 = time.perf_counter()
        if self.pending is not None:
            self.pending.wait()
        return time.perf_counter() - t0

    def failed(self) -> bool:
        return self.pending is not None and self.pending.failed()

    def raise_failure(self, step: int) -> None:
        self.wait()  # rank 0: raises the writer's CheckpointError (the one line naming step, folder and file)
        raise F.CheckpointError(f"rank 0 could not write a checkpoint (its error names the step, folder and file); "
                              f"stopped at optimizer step {step}; earlier checkpoints are intact: fix the storage, "
                              f"then continue with --resume auto")

    def close(self) -> None:
        """Wait for the save in flight without raising (the run is ending on another error)."""
        if self._thread is not None:
            self._thread.join()


__all__ = ["Cadence", "CheckpointManager", "LocalStorage", "PendingSave", "StateSnapshot", "Storage", "WeightsExport"]
