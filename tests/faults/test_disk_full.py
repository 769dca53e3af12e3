"""A full disk at checkpoint time: one clear error naming the step and the folder, the previous checkpoint
intact, and `--resume auto` (once there is space) ends bitwise equal to an uninterrupted run.

The unit tests need no Ray: a real tiny tmpfs where mounting one works (root), a path that fails with ENOSPC
without root (the file created on /dev/full instead), and an ENOSPC injected by the writer's test hook. The run stopped by a
full disk and resumed: tests/test_trainer.py.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import save_resume_state, trained_state

from minilm import checkpoint as C
from minilm import fsio
from minilm.config import TrainConfig
from minilm.testing import FaultHooks


def save(path: Path, step: int, model, optimizer, scaler, hooks=None) -> Path:
    return save_resume_state(path, model=model, optimizer=optimizer, scaler=scaler,
                             state={"optimizer_step": step, "note": "unit test"}, hooks=hooks)


@contextlib.contextmanager
def tiny_tmpfs(path: Path, size_bytes: int):
    """A real filesystem of `size_bytes` (needs root); yields None where mounting one is not allowed."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def full_device(tmp_path: Path) -> Path:
    """A device where every write fails with ENOSPC from the OS: /dev/full, or (a container without it, as root)
    one made with mknod. Neither possible: a visible skip naming why, never a silent pass."""
    import stat

    dev = Path("/dev/full")
    if dev.exists() and stat.S_ISCHR(dev.stat().st_mode):
        return dev
    made = tmp_path / "full"
    try:
        os.mknod(made, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
        return made
    except OSError as e:
        pytest.skip(f"no way to get ENOSPC from the OS here: no tmpfs mount, no /dev/full, no mknod ({e})")


def full_from(monkeypatch, folder: Path, name: str, device: Path) -> None:
    """Without root: creating `folder/name` opens a full device instead, so writing it fails with ENOSPC from the OS
    (minilm creates its files exclusively and never through a link, so a planted link would not do)."""
    real = fsio.create
    monkeypatch.setattr(fsio, "create", lambda f, *a, **k: open(device, "wb", buffering=0)
                        if Path(f) == folder / name else real(f, *a, **k))


def assert_full_disk_leaves_a_clean_state(error: C.CheckpointError, good: Path, bad: Path, model) -> None:
    message = str(error)
    assert "\n" not in message
    assert f"could not write the checkpoint of optimizer step 8 to {bad} (" in message
    assert "no space left on device" in message and "earlier checkpoints are intact" in message
    assert not (bad / C.MARKER).exists()
    with pytest.raises(C.CheckpointError, match="is incomplete: COMPLETE.json is missing"):
        C.load_resume_state(bad)  # nothing half-written is ever loaded
    loaded = C.load_resume_state(good)  # the previous checkpoint is intact
    assert loaded.state["optimizer_step"] == 4
    assert all(torch.equal(loaded.model_state[k], v) for k, v in model.state_dict().items())


def test_checkpoint_into_a_full_tmpfs_is_one_clear_error(tmp_path, monkeypatch):
    model, optimizer, scaler = trained_state()
    probe = save(tmp_path / "probe", 4, model, optimizer, scaler)
    pages = sum(math.ceil(f.stat().st_size / 4096) for f in probe.iterdir())
    # room for one checkpoint and a half: the second one runs out partway (without root: its optimizer.pt is
    # written to /dev/full, after its model.safetensors went through)
    with tiny_tmpfs(tmp_path / "disk", int(pages * 1.5) * 4096) as mounted:
        disk = mounted or tmp_path / "disk"
        if mounted is None:
            full_from(monkeypatch, disk / "checkpoint_00000008", "optimizer.pt", full_device(tmp_path))
        good = save(disk / "checkpoint_00000004", 4, model, optimizer, scaler)
        with pytest.raises(C.CheckpointError) as e:
            save(disk / "checkpoint_00000008", 8, model, optimizer, scaler)
        assert_full_disk_leaves_a_clean_state(e.value, good, disk / "checkpoint_00000008", model)


def test_checkpoint_with_an_injected_enospc_is_one_clear_error(tmp_path):
    model, optimizer, scaler = trained_state()
    good = save(tmp_path / "checkpoint_00000004", 4, model, optimizer, scaler)
    with pytest.raises(C.CheckpointError) as e:
        save(tmp_path / "checkpoint_00000008", 8, model, optimizer, scaler, hooks=FaultHooks(disk_full_at_step=8))
    assert "(optimizer.pt): no space left on device" in str(e.value)
    assert (tmp_path / "checkpoint_00000008" / "model.safetensors").is_file()  # failed partway, as asked
    assert_full_disk_leaves_a_clean_state(e.value, good, tmp_path / "checkpoint_00000008", model)


def test_a_full_disk_while_exporting_weights_is_one_clear_error(tmp_path):
    model, _, _ = trained_state()
    probe = C.export_weights(tmp_path / "probe", model, model.config)
    pages = math.ceil((probe / "model.safetensors").stat().st_size / 4096)
    with tiny_tmpfs(tmp_path / "disk", max(1, pages - 1) * 4096) as mounted, pytest.MonkeyPatch.context() as mp:
        disk = mounted or tmp_path / "disk"
        if mounted is None:  # without root: the weights file's bytes are written to a full device
            device = full_device(tmp_path)
            write = C.write_safetensors
            mp.setattr(C.files, "write_safetensors", lambda f, tensors, metadata=None: write(device, tensors, metadata))
        with pytest.raises(C.CheckpointError) as e:  # the weights do not fit
            C.export_weights(disk / "weights", model, model.config, step=8)
        assert str(e.value).startswith(f"could not write the checkpoint of optimizer step 8 to {disk / 'weights'} "
                                       f"(model.safetensors): no space left on device;")
        assert sorted(p.name for p in disk.iterdir()) == []  # nothing left behind: its space given back


def test_a_full_disk_during_the_background_write_is_one_clear_error(tmp_path, monkeypatch):
    """The checkpoint manager's background writer into a tmpfs run folder with room for one checkpoint and a half:
    the training thread's report returns, and waiting for the save raises the same one line naming the folder it was
    staged in; the previous checkpoint stays intact. (The run this stops, in-process: tests/test_trainer.py.)"""
    from minilm.fsio import staging_dir

    model, optimizer, scaler = trained_state()
    probe = save(tmp_path / "probe", 4, model, optimizer, scaler)
    pages = sum(math.ceil(f.stat().st_size / 4096) for f in probe.iterdir())
    with tiny_tmpfs(tmp_path / "disk", int(pages * 1.5) * 4096) as mounted:
        disk = mounted or tmp_path / "disk"
        if mounted is None:
            full_from(monkeypatch, staging_dir(disk, "00000008"), "optimizer.pt", full_device(tmp_path))
        manager = C.CheckpointManager(C.LocalStorage(disk), TrainConfig(), rank=0, device=torch.device("cpu"),
                                      say=lambda m: None)
        for step in (4, 8):
            manager.report(step, {}, model=model, optimizer=optimizer, scaler=scaler,
                           state={"optimizer_step": step, "note": "unit test"})
            if step == 4:
                manager.wait()
        with pytest.raises(C.CheckpointError) as e:
            manager.wait()
        assert manager.failed()
        assert_full_disk_leaves_a_clean_state(e.value, disk / "checkpoint_00000004", staging_dir(disk, "00000008"),
                                              model)
