"""Checkpoints that do not stall training: the training thread snapshots the state, a background writer writes it.

The training thread copies the state into reused host buffers (`StateSnapshot`) and goes on;
`CheckpointWriter` writes them on a background thread (the resume checkpoint, then the export when due), then
runs what the launcher asked for once the folder is complete (`PendingSave.then`, or Ray's upload waiting on
`PendingSave.wait`). At most one save is in flight, so the buffers are never overwritten while read.
`--checkpoint-mode sync` writes the live state from the same writer while the training thread waits.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import checkpoint as C
from .config import CHECKPOINT_MODES, ModelConfig


class StateSnapshot:
    """Host copies of the training state, in buffers reused from one snapshot to the next.

    On CUDA the buffers are pinned and filled with non-blocking copies on the current stream (the next
    step's kernels queue behind them), and `ready()` waits on the event recorded after the last copy;
    the writer calls it, the training thread never does. Elsewhere `copy_` is synchronous.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda" and torch.cuda.is_available()
        self.buffers: dict[str, torch.Tensor] = {}
        self.event = None

    def _buffer(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pinned)
            self.buffers[key] = buf
        buf.copy_(t.detach(), non_blocking=self.pinned)
        return buf

    def _copy(self, prefix: str, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._buffer(prefix, obj)
        if isinstance(obj, dict):
            return {k: self._copy(f"{prefix}/{k}", v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(f"{prefix}/{i}", v) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def take(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler) -> Snapshot:
        """The state as of now; its tensors are this object's buffers, valid until the next `take`."""
        snap = Snapshot(model_state=self._copy("model", dict(model.state_dict())),
                        optimizer_state=self._copy("optimizer", optimizer.state_dict()),
                        scaler_state=copy.deepcopy(scaler.state_dict()), event=None)
        if self.pinned:
            snap.event = torch.cuda.Event()
            snap.event.record()
        return snap


@dataclass
class Snapshot:
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict
    scaler_state: dict
    event: Any = None  # CUDA: the copies are complete once this event is

    def ready(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def live_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler) -> Snapshot:
    """The state itself, not a copy (sync mode: the training thread waits while it is written)."""
    return Snapshot(model_state=C.model_tensors(model.state_dict()), optimizer_state=optimizer.state_dict(),
                    scaler_state=scaler.state_dict())


@dataclass(frozen=True)
class WeightsExport:
    """The half-precision weights export to write into `<checkpoint>/weights` with this checkpoint."""

    config: ModelConfig
    tokenizer_path: Path | None = None
    dtype: torch.dtype = torch.float16


class PendingSave:
    """A checkpoint folder being written in the background: `wait()` for it (raises its CheckpointError),
    `then(fn)` to run `fn(path)` once it is complete (on the writer's thread, or here if it already is)."""

    def __init__(self, path: Path, step: int, blocking: bool):
        self.path, self.step = Path(path), step
        self.blocking = blocking  # the training thread waits for this one (sync mode, or the run's last save)
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._then: list[Callable[[Path], None]] = []
        self._closed = False

    def done(self) -> bool:
        return self._done.is_set()

    def failed(self) -> bool:
        return self._done.is_set() and self.error is not None

    def wait(self) -> Path:
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.path

    def then(self, fn: Callable[[Path], None]) -> None:
        with self._lock:
            if not self._closed:
                self._then.append(fn)
                return
        fn(self.wait())

    def _finish(self, error: BaseException | None) -> None:
        with self._lock:
            self._closed = True
            then, self._then = self._then, []
        try:
            if error is None:
                for fn in then:
                    fn(self.path)
        except BaseException as e:  # the launcher's hand-over failed: the save did
            error = e
        finally:
            self.error = error
            self._done.set()


class CheckpointWriter:
    """Rank 0's checkpoint writer: one save in flight at most, on a background thread."""

    def __init__(self, device: torch.device | str, mode: str = "async", hooks=None):
        if mode not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint mode must be one of {', '.join(CHECKPOINT_MODES)}, got {mode!r}")
        self.mode, self.hooks = mode, hooks
        self.snapshot = StateSnapshot(device)
        self.pending: PendingSave | None = None
        self._thread: threading.Thread | None = None

    def wait(self) -> float:
        """Wait for the save in flight (raising its error); the seconds waited."""
        t0 = time.perf_counter()
        if self.pending is not None:
            self.pending.wait()
        return time.perf_counter() - t0

    def failed(self) -> bool:
        """Has the last save failed (cheap: called every step)?"""
        return self.pending is not None and self.pending.failed()

    def close(self) -> None:
        """Wait for the save in flight without raising (the run is ending on another error)."""
        if self._thread is not None:
            self._thread.join()

    def start(self, path: Path, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler,
              state: dict, export: WeightsExport | None = None, blocking: bool = False) -> PendingSave:
        """Take the state (a snapshot in async mode) and write it into `path` on the writer thread. The caller
        has waited for the previous save (`wait`)."""
        if self.pending is not None and not self.pending.done():
            raise RuntimeError("a checkpoint is already being written: wait() for it first")
        blocking = blocking or self.mode == "sync"
        snap = live_state(model, optimizer, scaler) if blocking else self.snapshot.take(model, optimizer, scaler)
        pending = PendingSave(path, step, blocking)
        self._thread = threading.Thread(target=self._write, args=(pending, snap, dict(state), export),
                                        name=f"minilm-checkpoint-writer-{step}", daemon=True)
        self.pending = pending
        self._thread.start()
        return pending

    def _write(self, pending: PendingSave, snap: Snapshot, state: dict, export: WeightsExport | None) -> None:
        error = None
        try:
            snap.ready()
            C.write_resume_state(pending.path, model_state=snap.model_state, optimizer_state=snap.optimizer_state,
                                 scaler_state=snap.scaler_state, state=state, hooks=self.hooks)
            if export is not None:
                C.write_weights_export(pending.path / "weights", snap.model_state, export.config,
                                       export.tokenizer_path, export.dtype, step=pending.step)
        except BaseException as e:  # handed to whoever waits for this save
            error = e
        pending._finish(error)


__all__ = ["CHECKPOINT_MODES", "CheckpointWriter", "PendingSave", "StateSnapshot", "Snapshot", "WeightsExport"]
