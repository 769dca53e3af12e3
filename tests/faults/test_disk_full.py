"""A full disk at checkpoint time: one clear error naming the step and the folder, the previous checkpoint
intact, and `--resume auto` (once there is space) ends bitwise equal to an uninterrupted run.

The unit tests need no Ray: a real tiny tmpfs where mounting one works (root), and an ENOSPC injected
by the writer's test hook (MINILM_TEST_DISK_FULL_AT_STEP) everywhere.
"""

from __future__ import annotations

import contextlib
import math
import subprocess
from pathlib import Path

import pytest
import torch
from runs import bitwise_equal, error_lines, final_weights, is_complete, metric_steps, pretrain, tiny_args

from minilm import checkpoint as C
from minilm.config import ModelConfig, TrainConfig
from minilm.model import MiniMindForCausalLM
from minilm.step import make_grad_scaler, make_optimizer, optimizer_step


def trained_state():
    """A tiny model one optimizer step in, so the AdamW state is not empty."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    model = MiniMindForCausalLM(cfg)
    optimizer = make_optimizer(model, TrainConfig())
    scaler = make_grad_scaler(torch.float32, "cpu")
    optimizer_step(model, optimizer, scaler, [torch.randint(0, 256, (2, 17))], lr=1e-3, grad_clip=1.0)
    return model, optimizer, scaler


def save(path: Path, step: int, model, optimizer, scaler) -> Path:
    return C.save_resume_state(path, model=model, optimizer=optimizer, scaler=scaler,
                               state={"optimizer_step": step, "note": "unit test"})


@contextlib.contextmanager
def tiny_tmpfs(path: Path, size_bytes: int):
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'not root'}); "
                    f"the injected-ENOSPC case covers the same path")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


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


def test_checkpoint_into_a_full_tmpfs_is_one_clear_error(tmp_path):
    model, optimizer, scaler = trained_state()
    probe = save(tmp_path / "probe", 4, model, optimizer, scaler)
    pages = sum(math.ceil(f.stat().st_size / 4096) for f in probe.iterdir())
    # room for one checkpoint and a half: the second one runs out partway
    with tiny_tmpfs(tmp_path / "disk", int(pages * 1.5) * 4096) as disk:
        good = save(disk / "checkpoint_00000004", 4, model, optimizer, scaler)
        with pytest.raises(C.CheckpointError) as e:
            save(disk / "checkpoint_00000008", 8, model, optimizer, scaler)
        assert_full_disk_leaves_a_clean_state(e.value, good, disk / "checkpoint_00000008", model)


def test_checkpoint_with_an_injected_enospc_is_one_clear_error(tmp_path, monkeypatch):
    model, optimizer, scaler = trained_state()
    good = save(tmp_path / "checkpoint_00000004", 4, model, optimizer, scaler)
    monkeypatch.setenv("MINILM_TEST_DISK_FULL_AT_STEP", "8")
    with pytest.raises(C.CheckpointError) as e:
        save(tmp_path / "checkpoint_00000008", 8, model, optimizer, scaler)
    assert "(optimizer.pt): no space left on device" in str(e.value)
    assert (tmp_path / "checkpoint_00000008" / "model.safetensors").is_file()  # failed partway, as asked
    assert_full_disk_leaves_a_clean_state(e.value, good, tmp_path / "checkpoint_00000008", model)


def test_a_full_disk_while_exporting_weights_is_one_clear_error(tmp_path):
    model, _, _ = trained_state()
    probe = C.export_weights(tmp_path / "probe", model, model.config)
    pages = math.ceil((probe / "model.safetensors").stat().st_size / 4096)
    with tiny_tmpfs(tmp_path / "disk", max(1, pages - 1) * 4096) as disk:  # the weights do not fit
        with pytest.raises(C.CheckpointError) as e:
            C.export_weights(disk / "weights", model, model.config, step=8)
        assert str(e.value).startswith(f"could not write the checkpoint of optimizer step 8 to {disk / 'weights.tmp'} "
                                       f"(model.safetensors): no space left on device;")
        assert not (disk / "weights").exists() and not (disk / "weights.tmp").exists()  # its space given back


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_disk_full_at_a_checkpoint_stops_the_run_then_resume_auto_is_bitwise_equal(ray_address, run_data,
                                                                                     run_storage, baseline):
    name = "diskfull"
    run = run_storage / name
    args = tiny_args(run_data, run_storage, name, "--num-workers", "2")
    full = pretrain(ray_address, args, check=False, MINILM_TEST_DISK_FULL_AT_STEP="8")
    assert full.returncode == 1, full.stdout[-2000:] + full.stderr[-2000:]
    error = error_lines(full.stderr)
    assert len(error) == 1, full.stderr[-3000:]
    assert error[0].startswith("error: training failed: CheckpointError: could not write the checkpoint of "
                               "optimizer step 8 to ")
    assert "(optimizer.pt): no space left on device" in error[0] and "--resume auto" in error[0]
    assert is_complete(run / "checkpoint_00000004")  # the previous checkpoint is intact
    assert not (run / "checkpoint_00000008").exists()
    resumed = pretrain(ray_address, args + ["--resume", "auto"])
    assert f"resumed run {name} at optimizer step 4 " in resumed.stdout
    steps = metric_steps(run)
    assert steps == sorted(set(steps))
    assert bitwise_equal(final_weights(run_storage, name), baseline["weights"])
