"""Checkpoints written in the background (`minilm.async_checkpoint`, `--checkpoint-mode async`, the default): the
training thread only snapshots the state, and every guarantee of a synchronous checkpoint still holds.

Resume bitwise and against the replay, a kill during the background write, a full disk in the background
(in-process): tests/test_trainer.py, whose runs use the default mode; a real ENOSPC in the writer:
tests/faults/test_disk_full.py. Here: the writer's own units, the training going on while it writes, every way a
run ends waiting for the save in flight, keep-N pruning while a checkpoint is written, the export cadence, the
time-based cadence, and a resume's verification once per node.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import metrics, save_resume_state, trained_state
from inprocess import STEPS, checkpoint_weights, configs, run_local, torchrun, train_flags
from reference import check_run, replay
from safetensors import safe_open
from safetensors.torch import load_file, save

from minilm import checkpoint as C
from minilm import data as D
from minilm.checkpoint.manager import StateSnapshot
from minilm.config import TrainConfig
from minilm.step import optimizer_step
from minilm.testing import FaultHooks
from minilm.train import LocalLauncher
from minilm.trainer import Dataset, Preempted, RunOptions, Trainer

pytestmark = pytest.mark.timeout(300)


# ---- units ---------------------------------------------------------------------------------------

def test_the_streaming_safetensors_writer_writes_safetensors_bytes_and_their_hash(tmp_path):
    import hashlib

    tensors = {"w": torch.randn(3, 5), "ids": torch.arange(7), "h": torch.randn(4).half(), "b": torch.randn(2).bfloat16(),
               "mask": torch.tensor([True, False]), "empty": torch.zeros(0), "a.b": torch.randn(2, 2, 2)}
    digest = C.write_safetensors(tmp_path / "x.safetensors", tensors)
    written = (tmp_path / "x.safetensors").read_bytes()
    assert written == save(tensors)  # byte for byte the safetensors library's file
    assert digest == hashlib.sha256(written).hexdigest()
    metadata = {"format": "pt", "dtype": "float16"}
    digest = C.write_safetensors(tmp_path / "m.safetensors", tensors, metadata)
    assert digest == hashlib.sha256((tmp_path / "m.safetensors").read_bytes()).hexdigest()
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        assert f.metadata() == metadata
        assert all(torch.equal(f.get_tensor(k), v) for k, v in tensors.items())


def test_a_resume_checkpoint_is_hashed_as_written_and_verifies(tmp_path):
    model, optimizer, scaler = trained_state()
    path = save_resume_state(tmp_path / "c", model=model, optimizer=optimizer, scaler=scaler,
                             state={"optimizer_step": 1})
    marker = json.loads((path / C.MARKER).read_text())["files"]
    assert marker == {name: D.file_sha256(path / name) for name in C.RESUME_FILES}
    C.verify(path)


def test_the_snapshot_reuses_its_buffers_and_holds_the_state_of_its_step():
    """Host buffers are allocated once and refilled at every snapshot (on CUDA they are pinned: the same code with
    pin_memory); a snapshot keeps the values of its step while training moves on."""
    model, optimizer, scaler = trained_state()
    snapshots = StateSnapshot("cpu")
    assert not snapshots.pinned
    first = snapshots.take(model, optimizer, scaler, {})
    ptrs = {k: v.data_ptr() for k, v in snapshots.buffers.items()}
    before = {k: v.clone() for k, v in first.model_state.items()}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert first.model_state["lm_head.weight"].data_ptr() != first.model_state["model.embed_tokens.weight"].data_ptr()
    optimizer_step(model, optimizer, scaler, [torch.randint(0, 256, (2, 17))], lr=1e-3, grad_clip=1.0)
    assert all(torch.equal(before[k], v) for k, v in first.model_state.items())  # training moved on, the copy did not
    second = snapshots.take(model, optimizer, scaler, {})
    assert {k: v.data_ptr() for k, v in snapshots.buffers.items()} == ptrs  # no new allocation
    assert all(torch.equal(second.model_state[k], v) for k, v in model.state_dict().items())
    live = optimizer.state_dict()["state"]
    for i, s in second.optimizer_state["state"].items():
        assert all(torch.equal(s[k], live[i][k]) for k in s)
    assert second.optimizer_state["param_groups"] == optimizer.state_dict()["param_groups"]


def test_the_manager_writes_one_save_at_a_time_and_its_checkpoint_loads_as_the_live_state(tmp_path):
    model, optimizer, scaler = trained_state()
    (tmp_path / "run").mkdir()
    manager = C.CheckpointManager(C.LocalStorage(tmp_path / "run"), TrainConfig(), rank=0, device=torch.device("cpu"),
                                  say=lambda m: None)
    live = dict(model=model, optimizer=optimizer, scaler=scaler)
    manager.report(1, {}, **live, state={"optimizer_step": 1})
    first = manager.pending
    manager.report(2, {}, **live, state={"optimizer_step": 2})  # waits for the first: one save in flight at most
    assert first.done() and not first.failed() and manager.pending is not first
    manager.wait()
    loaded = C.load_resume_state(tmp_path / "run" / "checkpoint_00000002")
    assert all(torch.equal(loaded.model_state[k], v) for k, v in model.state_dict().items())
    sync = save_resume_state(tmp_path / "sync", model=model, optimizer=optimizer, scaler=scaler,
                             state={"optimizer_step": 2, "checkpoint_index": 2})
    assert_same_checkpoint(sync, tmp_path / "run" / "checkpoint_00000002")  # the snapshot's files hold the live state's


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def assert_same_checkpoint(a: Path, b: Path) -> None:
    """The same bytes for the safetensors and JSON files; the same loaded content for torch.save's (whose zip
    carries a serialization id of its own every time)."""
    for name in ("model.safetensors", "state.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    for name in ("optimizer.pt", "scaler.pt"):
        assert same(torch.load(a / name, weights_only=True), torch.load(b / name, weights_only=True)), name


# ---- runs ----------------------------------------------------------------------------------------

class Stopping(LocalLauncher):
    """A local launcher that raises SIGTERM or a node drain after optimizer step `after`."""

    def __init__(self, *args, stop: str, after: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.stop, self.after, self.calls = stop, after, 0

    def stop_flags(self) -> tuple[bool, bool]:
        self.calls += 1
        raised = self.calls >= self.after
        return (raised and self.stop == "sigterm", raised and self.stop == "drain")


@dataclass(frozen=True)
class SeeAtMarker(FaultHooks):
    """Before each marker (on the writer's thread), records the run folder's complete checkpoints."""

    seen: list | None = None
    run_dir: str | None = None

    def before_marker(self, path: Path, step: int | None) -> None:
        self.seen.append((step, [n for n in C.RunFolder(self.run_dir).checkpoints()
                                 if (Path(self.run_dir) / n / C.MARKER).is_file()]))
        super().before_marker(path, step)


def make_trainer(data_dir: Path, run_dir: Path, *, launcher_cls=LocalLauncher, launcher_kwargs=None,
                 hooks: FaultHooks | None = None, run_kwargs=None, **train) -> Trainer:
    model_cfg, train_cfg = configs(**train)
    data = Dataset.prepared(D.open_prepared(data_dir))
    launcher = launcher_cls(data, train_cfg.micro_batch_size, run_dir=run_dir, say=lambda m: None,
                            **(launcher_kwargs or {}))
    run_dir.mkdir(parents=True, exist_ok=True)
    return Trainer(model_cfg, train_cfg, RunOptions(name=run_dir.name, run_dir=str(run_dir), **(run_kwargs or {})),
                   data, launcher, hooks=hooks or FaultHooks())


def complete(run_dir: Path) -> list[int]:
    return [int(n.split("_")[1]) for n in C.RunFolder(run_dir).checkpoints() if (run_dir / n / C.MARKER).is_file()]


def test_training_goes_on_while_the_writer_writes_and_the_next_save_waits_for_it(run_data, tmp_path):
    """The writer of checkpoint 4 is held 1.5 s before its marker: steps 5-7 are trained meanwhile (their times
    come before the marker's), and checkpoint 8 waits for it, which the next log line reports as
    checkpoint_wait_s. The run is bitwise the sync run."""
    ids, run_dir = tmp_path / "ids", tmp_path / "async"
    run_local(run_data, run_dir, record=ids, max_steps=12, hooks={"checkpoint_delay_s": 1.5,
                                                                   "checkpoint_delay_step": 4})
    marker_time = (run_dir / "checkpoint_00000004" / C.MARKER).stat().st_mtime
    step_times = {r["optimizer_step"]: r["time"] for r in map(json.loads, (ids / "rank0.jsonl").read_text().splitlines())}
    assert step_times[7] < marker_time
    records = {r["optimizer_step"]: r for r in metrics(run_dir)}
    assert records[12]["checkpoint_wait_s"] > 0.5 and records[8]["checkpoint_wait_s"] < 0.5
    run_local(run_data, tmp_path / "sync", checkpoint_mode="sync", max_steps=12)
    for step in (8, 12):
        a, b = (d / f"checkpoint_{step:08d}" for d in (run_dir, tmp_path / "sync"))
        assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
        for name in ("optimizer.pt", "scaler.pt"):
            assert same(torch.load(a / name, weights_only=True), torch.load(b / name, weights_only=True)), name


@pytest.mark.parametrize("stop", ["sigterm", "drain", "exit-after-steps", "exit-after-minutes", "end"])
def test_every_end_of_a_run_waits_for_the_save_in_flight(run_data, tmp_path, stop):
    """Checkpoint 2's writer is held 1 s; the run ends at step 5 (SIGTERM or a drain raised after step 3 and agreed
    two steps later, --exit-after-steps 5, --exit-after-minutes, the last step): when fit returns or raises,
    checkpoints 2 and 5 are both complete, 5 is the one a resume takes, and the last save waited for the first."""
    run_dir = tmp_path / "run"
    kwargs = dict(checkpoint_every=2, log_every=1, max_steps=5 if stop == "end" else 8,
                  hooks=FaultHooks(checkpoint_delay_s=1.0, checkpoint_delay_step=2))
    if stop in ("sigterm", "drain"):
        kwargs.update(launcher_cls=Stopping, launcher_kwargs={"stop": stop, "after": 3})
    elif stop == "exit-after-steps":
        kwargs.update(run_kwargs={"exit_after_steps": 5})
    elif stop == "exit-after-minutes":  # the time limit is up after step 3 (the steps are held 0.4 s each)
        kwargs.update(run_kwargs={"exit_after_minutes": 1.0 / 60},
                      hooks=FaultHooks(checkpoint_delay_s=1.0, checkpoint_delay_step=2, step_delay_s=0.4))
    trainer = make_trainer(run_data, run_dir, **kwargs)
    if stop in ("sigterm", "drain"):
        with pytest.raises(Preempted, match="at optimizer step 5: checkpoint written"):
            trainer.fit()
    else:
        assert trainer.fit() == ("finished" if stop == "end" else "exited")
    last = trainer.step
    if stop != "exit-after-minutes":  # (the time limit's step depends on the machine's speed)
        assert last == 5 and complete(run_dir) == [2, 4, 5]
    assert last > 2 and last in complete(run_dir) and 2 in complete(run_dir)
    assert C.RunFolder(run_dir).newest_complete() == f"checkpoint_{last:08d}"
    assert (run_dir / f"checkpoint_{last:08d}" / "weights" / C.MARKER).is_file()  # the last save exports the weights
    if stop != "exit-after-minutes":  # (there the held steps overlap most of the writer's delay)
        waits = [r.get("checkpoint_wait_s", 0.0) for r in metrics(run_dir)] + [trainer.checkpoints.wait_s]
        assert max(waits) > 0.5, waits  # the next save waited for checkpoint 2's held writer
    assert not list(run_dir.glob(".staging-*"))


def test_pruning_keeps_the_newest_complete_checkpoint_while_the_next_is_written(run_data, tmp_path):
    """--keep-checkpoints 1: while each checkpoint is written (seen by its writer just before its marker) the
    previous one is still complete in the run folder; a torn folder of a later step (left by a kill) does not
    make pruning remove the checkpoint just completed."""
    run_dir, seen = tmp_path / "keep1", []
    trainer = make_trainer(run_data, run_dir, run_kwargs={"keep_checkpoints": 1}, max_steps=12,
                           hooks=SeeAtMarker(seen=seen, run_dir=str(run_dir)))
    (run_dir / "checkpoint_00000099").mkdir()  # torn: no marker
    trainer.fit()
    assert seen == [(4, []), (8, ["checkpoint_00000004"]), (12, ["checkpoint_00000008"])]
    assert complete(run_dir) == [12]


def test_prune_never_removes_the_newest_complete_checkpoint(tmp_path):
    marker = json.dumps({"files": {"model.safetensors": "0" * 64}})
    for name in ("checkpoint_00000004", "checkpoint_00000008", "checkpoint_00000012"):
        (tmp_path / name).mkdir()
        (tmp_path / name / C.MARKER).write_text(marker)
    (tmp_path / "checkpoint_00000016").mkdir()  # torn (no marker), of a later step
    def manager(keep: int) -> C.CheckpointManager:
        return C.CheckpointManager(C.LocalStorage(tmp_path), TrainConfig(), rank=0, device=torch.device("cpu"), keep=keep)

    assert manager(2).prune("checkpoint_00000012") == ["checkpoint_00000004"]
    assert manager(1).prune("checkpoint_00000012") == ["checkpoint_00000008"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_00000012", "checkpoint_00000016"]


def test_the_weights_export_has_its_own_cadence_and_is_always_at_the_end(run_data, tmp_path):
    """--export-every 2, a checkpoint every 4 steps, the run stopped at 10 and resumed: weights/ with every 2nd
    checkpoint of the run (8, 12: the count goes on across the resume) and with each run's last (10, 20)."""
    run_dir = tmp_path / "export2"
    assert make_trainer(run_data, run_dir, export_every=2,
                        run_kwargs={"exit_after_steps": 10, "keep_checkpoints": 10}).fit() == "exited"
    assert make_trainer(run_data, run_dir, export_every=2, run_kwargs={"keep_checkpoints": 10}).fit() == "finished"
    exported = [s for s in complete(run_dir) if (run_dir / f"checkpoint_{s:08d}" / "weights" / C.MARKER).is_file()]
    assert complete(run_dir) == [4, 8, 10, 12, 16, 20]
    assert exported == [8, 10, 12, 20]
    weights = load_file(str(run_dir / "checkpoint_00000020" / "weights" / "model.safetensors"))
    fp32 = checkpoint_weights(run_dir)
    assert weights.keys() == fp32.keys() and all(torch.equal(weights[k], fp32[k].half()) for k in fp32)


@pytest.mark.slow  # two torchrun runs (~12 s)
def test_a_time_based_checkpoint_is_taken_at_the_same_step_on_every_rank(run_data, tmp_path):
    """--checkpoint-every-minutes under torchrun (2 ranks, steps held 0.25 s, a checkpoint due every 0.6 s, the
    step cadence out of reach): rank 0's clock raises the flag, every rank checkpoints at the step it is agreed
    (a rank that did not would leave the other waiting in the loss all-reduce of its log step), and the run
    is the replay's."""
    run_dir, ids = tmp_path / "minutes", tmp_path / "ids"
    ids.mkdir()
    flags = train_flags(run_data, run_dir, checkpoint_every=1000, log_every=1000) + [
        "--checkpoint-every-minutes", "0.01", "--keep-checkpoints", "100"]
    torchrun(2, flags, MINILM_TEST_STEP_DELAY_S="0.25", MINILM_TEST_RECORD_SAMPLE_IDS=str(ids))
    steps = complete(run_dir)
    assert steps[-1] == STEPS and len(steps) >= 4, steps  # some time-based checkpoints and the last
    assert all(b - a >= 3 for a, b in zip(steps[:-2], steps[1:-1], strict=True)), steps  # one flag per checkpoint
    assert [r["optimizer_step"] for r in metrics(run_dir)] == steps  # a log line with each, on both ranks
    check_run(replay(*configs(), run_data, ids, STEPS), checkpoint_weights(run_dir), metrics(run_dir))


# ---- resume verified once per node --------------------------------------------------------------

def test_a_resume_hashes_each_file_once_per_node(run_data, tmp_path, monkeypatch):
    """Two ranks of one node (two Trainers in one process, one cache) resume checkpoint 8: each of its files is
    hashed once in all, not twice per rank (to pick it, to load it). A file changed after that is hashed
    again and refused."""
    run_dir = tmp_path / "once"
    assert make_trainer(run_data, run_dir, run_kwargs={"exit_after_steps": 8}).fit() == "exited"
    for f in (run_dir / "checkpoint_00000008").rglob("*"):  # older than fsio.RACY_NS: a fresher one is not stamped
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns - 10**10))
    hashed = []
    real = C.file_sha256
    monkeypatch.setattr(C.files, "file_sha256", lambda f: hashed.append(Path(f)) or real(f))
    for _ in range(2):
        assert make_trainer(run_data, run_dir).step == 8
    ckpt = run_dir / "checkpoint_00000008"
    assert sorted(hashed) == sorted(ckpt / name for name in C.RESUME_FILES)
    with open(ckpt / "optimizer.pt", "r+b") as f:  # the same size, one byte changed
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(C.CheckpointError, match="checkpoint_00000008 is corrupt: optimizer.pt"):
        C.load_resume_state(ckpt, once_per_node=True)
    assert make_trainer(run_data, run_dir).step == 4  # --resume auto passes over it


def test_a_remote_checkpoint_is_downloaded_to_the_node_and_removed_after_load(run_data, tmp_path, monkeypatch):
    """A run folder on storage that is not a local filesystem: the manager loads the newest checkpoint from the node's
    one download (Ray's as_directory, shared by the node's ranks: `ray_jobs.worker.download`) and leaves it once the
    state is loaded, so the download is removed; nothing is copied into a temporary folder of its own."""
    from types import SimpleNamespace

    import pyarrow.fs
    import ray.train

    from ray_jobs import worker

    run_dir = tmp_path / "remote"
    assert make_trainer(run_data, run_dir, run_kwargs={"exit_after_steps": 8}).fit() == "exited"
    fs = pyarrow.fs.SubTreeFileSystem("/", pyarrow.fs.LocalFileSystem())  # not a LocalFileSystem: "remote"
    monkeypatch.setattr(ray.train, "get_context", lambda: SimpleNamespace(
        get_storage=lambda: SimpleNamespace(storage_filesystem=fs)))
    downloads = []

    @contextlib.contextmanager
    def download(fs_path):
        with worker.download(fs_path) as path:
            downloads.append(Path(path))
            C.verify(path)
            yield path

    folder = C.RunFolder(str(run_dir).lstrip("/"), fs, download=download)
    assert folder.local is None and folder.newest_complete() == "checkpoint_00000008"  # its marker, its files
    storage = SimpleNamespace(folder=folder, staging=tmp_path)
    loaded = C.CheckpointManager(storage, configs()[1], rank=0, device=torch.device("cpu")).load()
    assert loaded.state["optimizer_step"] == 8
    assert len(downloads) == 1 and downloads[0] != run_dir / "checkpoint_00000008" and not downloads[0].exists()
