"""The function Ray Train runs on every rank: the `minilm.trainer.Trainer` loop behind a Ray adapter.

The adapter is all that is Ray here: the Ray Data stream in (`ray_jobs.stream.RankStream`),
`ray.train.report` with the checkpoint folder out (a barrier: every rank reports at the same steps,
rank 0 attaches the checkpoint), the checkpoint to resume from (Ray's registered one, or a newer
complete one in the run folder), and SIGTERM / node drains in as stop flags.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
from pathlib import Path

import ray.train
import torch

from minilm import checkpoint as C
from minilm import data as D
from minilm.async_checkpoint import PendingSave
from minilm.config import ModelConfig, TrainConfig
from minilm.distributed import CollectiveError, collective_failure, collective_timeout_s
from minilm.options import RunOptions
from minilm.trainer import Dataset, Preempted, Trainer

from . import console, dashboard_metrics, ray_compat
from .cli import available_cores, redact_uri
from .stream import RankStream


def train_func(config: dict) -> None:
    run, train_cfg = config["run"], TrainConfig.from_dict(config["train"])
    launcher = RayLauncher(run, train_cfg.micro_batch_size)
    prepared = D.open_local(run["data_dir"])  # a remote --data is copied to this node once
    trainer = Trainer(ModelConfig.from_dict(config["model"]), train_cfg, RunOptions.from_dict(run),
                      Dataset.prepared(prepared), launcher)
    outcome = "failed"
    try:
        outcome = "finished" if trainer.fit() == "finished" else "killed"  # killed: to be continued
    except Preempted:
        outcome = "killed"
        raise
    except RuntimeError as e:  # a rank that hangs or died: one line, and the worker group fails (restarts)
        line = collective_failure(e, collective_timeout_s(launcher.device.type, run.get("collective_timeout_s")),
                                  launcher.rank, launcher.world_size) if launcher.world_size > 1 else None
        if line is None:
            raise
        console.say(f"warning: {line}")
        raise CollectiveError(line) from None
    finally:
        trainer.close(outcome)


class RayLauncher:
    """Where a Ray Train worker's batches come from, where its checkpoints go, and what stops it."""

    def __init__(self, run: dict, micro_batch_size: int):
        ctx = ray.train.get_context()
        self.rank, self.world_size = ctx.get_world_rank(), ctx.get_world_size()
        ray_compat.quiet_train_report_logs()
        self.device: torch.device = ray.train.torch.get_device()
        if self.device.type == "cuda":  # this thread's current device: kernels, NCCL and the allocator use it
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu":
            cap_threads(ctx.get_local_world_size())
        self.run, self.micro_batch_size = run, micro_batch_size
        self.sigterm = False
        try:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # Ray runs train_func in a thread; Ray's own handler lives in the main thread
            ray_compat.defer_sigterm_exit(self._on_sigterm)
        self._calls = 0
        self._async_reports = False  # rank 0: a checkpoint may still be uploading
        self._download: contextlib.ExitStack | None = None  # a remote checkpoint's download, until loaded

    def _on_sigterm(self, *_):
        self.sigterm = True

    def batches(self, order: D.RankOrder, total_steps: int) -> RankStream:
        return RankStream(self.run["data_dir"], order, total_steps, self.micro_batch_size, self.device)

    def checkpoint_to_resume(self, log) -> Path | None:
        """The newest complete checkpoint beside Ray's latest registered one; without one, the newest complete
        one in the run folder (written but not yet registered when the run restarted), else the driver's
        `resume_path` (--resume PATH, or what the run folder held when the driver started)."""
        latest = ray.train.get_checkpoint()
        if latest is None:
            in_run = C.latest_complete(C.checkpoint_dirs(self.run.get("run_dir")), log, once_per_node=True)
            if in_run is not None:
                return in_run
            return Path(self.run["resume_path"]) if self.run.get("resume_path") else None
        local = Path(latest.path)
        if local.is_dir():
            # Newer complete folders count too: a checkpoint uploaded just before its node died may not be
            # registered yet (the controller registers reports when it next polls the workers).
            found = C.latest_complete(C.checkpoint_dirs(local.parent), log, once_per_node=True)
            if found is None:
                raise C.CheckpointError(f"run {self.run['name']} has checkpoints under {local.parent} but none "
                                        f"is complete")
            return found
        # Remote storage: Ray downloads it once per node into a node-local folder that every rank of the node
        # reads, and removes it once the last of them has left the context (`resume_loaded`).
        self._download = contextlib.ExitStack()
        return Path(self._download.enter_context(latest.as_directory()))

    def resume_loaded(self) -> None:
        if self._download is not None:
            self._download.close()
            self._download = None

    def staging_dir(self, step: int) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"minilm-ckpt-{step}-"))

    def report(self, metrics: dict, checkpoint: PendingSave | None, checkpointing: bool) -> None:
        """ray.train.report on every rank (a barrier); rank 0 publishes the dashboard gauges and attaches the
        checkpoint. One still being written goes with Ray's ASYNC upload through `upload_when_written`, and rank
        0's reports stay ASYNC until the next SYNC one (a blocking checkpoint, already complete), which waits for
        every upload before it."""
        if self.rank == 0:
            dashboard_metrics.publish(metrics, self.run["name"])
        public = {k: v for k, v in metrics.items() if k != "expert_load"}
        step = metrics["optimizer_step"]
        blocking = checkpoint is not None and checkpoint.blocking
        uploading_later = checkpoint is not None and not blocking
        asynchronous = (self._async_reports or uploading_later) and not blocking
        mode = {"checkpoint_upload_mode": ray.train.CheckpointUploadMode.ASYNC} if asynchronous else {}
        if not checkpointing:
            ray.train.report(public, **mode)
            return
        dir_name = C.checkpoint_dir_name(self.run.get("run_dir"), step)
        ckpt = ray.train.Checkpoint.from_directory(checkpoint.path) if checkpoint is not None else None
        storage = self.run.get("run_dir") or self.run.get("storage_dir") or "the storage path"
        target = f"{redact_uri(storage)}/{dir_name}"  # a message's name for it: no credentials
        if uploading_later:
            self._async_reports = True
            ray.train.report(public, checkpoint=ckpt, checkpoint_dir_name=dir_name,
                             checkpoint_upload_fn=upload_when_written(checkpoint, target), **mode)
            return
        try:
            with upload_errors(target, step) if ckpt is not None else contextlib.nullcontext():
                ray.train.report(public, checkpoint=ckpt, checkpoint_dir_name=dir_name, **mode)
        finally:
            if checkpoint is not None:
                shutil.rmtree(checkpoint.path, ignore_errors=True)
                self._async_reports = False  # a SYNC report returns after every upload before it

    def stop_flags(self) -> tuple[bool, bool]:
        self._calls += 1
        return self.sigterm, ray_compat.drain_announced(self._calls)

    def say(self, message: str) -> None:
        console.say(message)


@contextlib.contextmanager
def upload_errors(target: str, step: int):
    """A storage that refuses an upload (pyarrow raises OSError) or is full: one CheckpointError line."""
    try:
        yield
    except Exception as e:
        if not (isinstance(e, OSError) or C.is_disk_full(e)):
            raise
        raise C.CheckpointError(C.write_error(target, step, "upload", e)) from None


def upload_when_written(checkpoint: PendingSave, target: str):
    """Ray's upload function for a checkpoint still being written: wait for the writer (its CheckpointError
    fails the run, through Ray's eager raising of a failed async upload), copy the folder into the run's
    storage, remove the staging folder."""
    storage = ray.train.get_context().get_storage()

    def upload(ckpt: ray.train.Checkpoint, dir_name: str) -> ray.train.Checkpoint:
        try:
            checkpoint.wait()
            with upload_errors(target, checkpoint.step):
                return storage.persist_current_checkpoint(ckpt, dir_name)
        finally:
            shutil.rmtree(checkpoint.path, ignore_errors=True)

    return upload


def cap_threads(local_workers: int) -> None:
    """A CPU worker's threads (OMP_NUM_THREADS, from --cpus-per-worker) stay within this node's cores shared among
    the run's workers on it. A node's logical CPUs can overstate its cores (a local Ray declares more so that Ray
    Data's tasks are not starved: ensure_ray), and threads beyond the cores spin against each other."""
    share = max(1, available_cores() // max(1, local_workers))
    if torch.get_num_threads() > share:
        torch.set_num_threads(share)


__all__ = ["train_func", "RayLauncher", "Preempted"]
