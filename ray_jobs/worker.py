"""The function Ray Train runs on every rank: the `minilm.trainer.Trainer` loop behind a Ray adapter (the Ray Data
stream in, `ray.train.report` as the storage, SIGTERM and node drains as stop flags)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from pathlib import Path

import ray.train
import torch

from minilm import checkpoint as C
from minilm import data as D
from minilm import fsio
from minilm.distributed import CollectiveError, collective_failure, collective_timeout_s
from minilm.options import RunSpec
from minilm.trainer import Dataset, Preempted, Trainer

from . import console, dashboard_metrics, ray_compat
from .cli import RayOptions, available_cores
from .stream import RankStream


def train_func(config: dict) -> None:
    os.umask(0o027)  # what Ray uploads into the run folder: readable by its owner and group only
    spec = RunSpec.from_dict(with_secrets(config), RayOptions)
    launcher = RayLauncher(spec)
    prepared = D.open_local(spec.options.data_dir)  # a remote --data is copied to this node once
    trainer = Trainer(spec.model, spec.train, spec.options, Dataset.prepared(prepared), launcher, steps=spec.steps)
    outcome = "failed"
    try:
        outcome = "finished" if trainer.fit() == "finished" else "killed"  # killed: to be continued
    except Preempted:
        outcome = "killed"
        raise
    except RuntimeError as e:  # a rank that hangs or died: one line, and the worker group fails (restarts)
        timeout = collective_timeout_s(launcher.device.type, spec.options.collective_timeout_s)
        line = collective_failure(e, timeout, launcher.rank, launcher.world_size) if launcher.world_size > 1 else None
        if line is None:
            raise
        console.say(f"warning: {line}")
        raise CollectiveError(line) from None
    finally:
        trainer.close(outcome)


def with_secrets(config: dict) -> dict:
    """The run's config with the credentials `ray_jobs.pretrain.without_secrets` kept out of train_loop_config."""
    if "secrets" not in config:
        return config
    return {**config, "run": {**config["run"], **ray.get(config["secrets"])}}


class RayLauncher:
    """Where a Ray Train worker's batches come from, where its checkpoints go, and what stops it."""

    def __init__(self, spec: RunSpec):
        ctx = ray.train.get_context()
        self.rank, self.world_size = ctx.get_world_rank(), ctx.get_world_size()
        ray_compat.quiet_train_report_logs()
        self.device: torch.device = ray.train.torch.get_device()
        if self.device.type == "cuda":  # this thread's current device: kernels, NCCL and the allocator use it
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu":
            cap_threads(ctx.get_local_world_size())
        self.data_dir, self.micro_batch_size = spec.options.data_dir, spec.train.micro_batch_size
        self.storage = RayStorage(spec.options.name, spec.options.storage_dir)
        self.sigterm, self._calls = False, 0
        try:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # Ray runs train_func in a thread; Ray's own handler lives in the main thread
            ray_compat.defer_sigterm_exit(self._on_sigterm)

    def _on_sigterm(self, *_):
        self.sigterm = True

    def batches(self, order: D.RankOrder, total_steps: int) -> RankStream:
        return RankStream(self.data_dir, order, total_steps, self.micro_batch_size, self.device)

    def stop_flags(self) -> tuple[bool, bool]:
        self._calls += 1
        return self.sigterm, ray_compat.drain_announced(self._calls)

    def say(self, message: str) -> None:
        console.say(message)


class RayStorage:
    """The run folder under Ray's storage path (local, NFS, s3://, gs://): checkpoints are published by
    `ray.train.report`, which Ray uploads (in the background for a save still being written)."""

    def __init__(self, name: str, display: str):
        storage = ray.train.get_context().get_storage()
        self.folder = C.RunFolder(storage.experiment_fs_path, storage.storage_filesystem, download=download,
                                  display=display)
        # a private folder of this user's on the node: in the shared temp folder another user could plant a link
        self.staging = fsio.private_folder(Path(tempfile.gettempdir()) / f"minilm-staging-{os.getuid()}")
        self.name, self._async_reports = name, False  # rank 0: a checkpoint may still be uploading

    def report(self, metrics: dict, save: C.PendingSave | None) -> None:
        """ray.train.report on every rank (a barrier); rank 0 attaches its save. One still being written goes ASYNC
        (`upload_when_written`), and reports stay ASYNC until a blocking save's SYNC one waits for every upload."""
        if ray.train.get_context().get_world_rank() == 0:
            dashboard_metrics.publish(metrics, self.name)
        public = {k: v for k, v in metrics.items() if k != "expert_load"}
        blocking = save is not None and save.blocking
        self._async_reports = (self._async_reports or save is not None) and not blocking
        mode = {"checkpoint_upload_mode": ray.train.CheckpointUploadMode.ASYNC} if self._async_reports else {}
        if save is None:
            return ray.train.report(public, **mode)
        name = self.folder.next_name(save.step)
        ckpt = ray.train.Checkpoint.from_directory(save.path)
        if not blocking:  # the upload function removes the staging folder, so Ray's own delete would find none
            return ray.train.report(public, checkpoint=ckpt, checkpoint_dir_name=name, **mode,
                                    checkpoint_upload_fn=self.upload_when_written(save, name),
                                    delete_local_checkpoint_after_upload=False)
        try:
            with upload_errors(f"{self.folder.display}/{name}", save.step):
                ray.train.report(public, checkpoint=ckpt, checkpoint_dir_name=name)
            save.published(name)
        except BaseException as e:  # kept for the manager's wait, as on the writer's thread
            save.error = e
        finally:
            shutil.rmtree(save.path, ignore_errors=True)

    def written(self, save: C.PendingSave) -> None:
        """Nothing: `report` gave the save to Ray, which uploads it once it is written."""

    def upload_when_written(self, save: C.PendingSave, name: str):
        """Ray's upload function for a save still being written: wait for the writer (its error fails the run),
        copy the folder into storage, hand it back to the manager, remove the staging folder."""
        storage = ray.train.get_context().get_storage()

        def upload(ckpt: ray.train.Checkpoint, dir_name: str) -> ray.train.Checkpoint:
            try:
                save.wait()
                with upload_errors(f"{self.folder.display}/{name}", save.step):
                    persisted = storage.persist_current_checkpoint(ckpt, dir_name)
                save.published(name)
                return persisted
            finally:
                shutil.rmtree(save.path, ignore_errors=True)

        return upload


@contextlib.contextmanager
def download(fs_path: str):
    """A remote checkpoint, downloaded once per node for every rank there (Ray's as_directory)."""
    storage = ray.train.get_context().get_storage()
    with ray.train.Checkpoint(fs_path, filesystem=storage.storage_filesystem).as_directory() as path:
        yield path


@contextlib.contextmanager
def upload_errors(target: str, step: int):
    """A storage that refuses an upload (pyarrow raises OSError) or is full: one CheckpointError line."""
    try:
        yield
    except Exception as e:
        if not (isinstance(e, OSError) or C.is_disk_full(e)):
            raise
        raise C.CheckpointError(C.write_error(target, step, "upload", e)) from None


def cap_threads(local_workers: int) -> None:
    """A CPU worker's threads stay within its share of the node's cores, which its logical CPUs may overstate
    (ensure_ray): threads beyond the cores spin against each other."""
    share = max(1, available_cores() // max(1, local_workers))
    if torch.get_num_threads() > share:
        torch.set_num_threads(share)
