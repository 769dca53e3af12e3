"""SIGKILL: of the driver, of one worker, and of the run while a checkpoint is being written.

Each run finishes, by `--resume auto` or by a `--max-failures` restart, with final fp32 weights
bitwise equal to the uninterrupted `baseline` run (same world size).
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
from runs import (
    STEPS,
    bitwise_equal,
    final_weights,
    is_complete,
    metric_steps,
    pretrain,
    ray_train_workers,
    start_pretrain,
    start_until_checkpoint,
    tiny_args,
    wait_for,
    wait_until_workers_exit,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


@pytest.mark.slow
def test_driver_killed_then_resume_auto_is_bitwise_equal(ray_address, run_data, run_storage, baseline):
    """The driver dies the moment checkpoint 4 is complete in storage. Ray Train registers a checkpoint
    only once every rank's report reached its controller, so it usually has not yet: the resumed run
    must continue checkpoint 4 from the run folder all the same, not start fresh."""
    name = "killed"
    args = tiny_args(run_data, run_storage, name, "--num-workers", "2")
    first = run_storage / name / "checkpoint_00000004"
    proc = start_pretrain(ray_address, args, capture=False, MINILM_TEST_STEP_DELAY_S="1.0")  # 4 s to checkpoint 8
    wait_for(lambda: is_complete(first), proc, "checkpoint 4 was complete in storage", poll=0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    wait_until_workers_exit()
    assert not (run_storage / name / "checkpoint_00000008").exists()
    resumed = pretrain(ray_address, args + ["--resume", "auto"])
    assert f"resumed run {name} at optimizer step 4 " in resumed.stdout
    assert bitwise_equal(final_weights(run_storage, name), baseline["weights"])


@pytest.mark.slow
def test_sigkilled_worker_recovers_with_max_failures(ray_address, run_data, run_storage, baseline):
    name = "workerkill"
    args = tiny_args(run_data, run_storage, name, "--num-workers", "2", "--max-failures", "1")
    # checkpoint 4 is surely registered with Ray once checkpoint 8 is written
    proc = start_until_checkpoint(ray_address, args, run_storage / name / "checkpoint_00000008" / "COMPLETE.json",
                                  capture=True)
    workers = ray_train_workers()
    assert workers, "no Ray Train worker process found"
    workers[0].send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert f"resumed run {name} at optimizer step" in out
    assert f"step {STEPS}/{STEPS}" in out
    steps = metric_steps(run_storage / name)
    assert steps == sorted(set(steps))  # redone steps replaced, not appended
    assert bitwise_equal(final_weights(run_storage, name), baseline["weights"])


@pytest.mark.slow
def test_killed_during_a_checkpoint_write_resumes_from_the_previous_checkpoint(ray_address, run_data, run_storage,
                                                                               baseline, tmp_path):
    """SIGKILL while rank 0 writes checkpoint 8 (every file there but COMPLETE.json), and a folder of
    checkpoint 8 in storage torn by the kill mid-upload (the marker copied, state.json not): the
    resumed run skips the torn folder, continues checkpoint 4 and ends bitwise equal to the baseline."""
    name = "killwrite"
    run = run_storage / name
    args = tiny_args(run_data, run_storage, name, "--num-workers", "2")
    paused = tmp_path / "paused"
    proc = start_pretrain(ray_address, args, capture=False, MINILM_TEST_CHECKPOINT_DELAY_S="600",
                          MINILM_TEST_CHECKPOINT_DELAY_STEP="8", MINILM_TEST_CHECKPOINT_PAUSED=str(paused))
    wait_for(paused.is_file, proc, "the writer of checkpoint 8 paused before its marker")
    partial = Path(paused.read_text())
    try:
        assert all((partial / f).is_file() for f in ("model.safetensors", "optimizer.pt", "scaler.pt", "state.json"))
        assert not (partial / "COMPLETE.json").exists()
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        wait_until_workers_exit()
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # a killed writer cannot clean up its temporary folder
    assert is_complete(run / "checkpoint_00000004")
    assert not (run / "checkpoint_00000008").exists()  # nothing of the interrupted write reached storage
    torn = run / "checkpoint_00000008"
    torn.mkdir()
    for f in ("COMPLETE.json", "scaler.pt"):
        shutil.copyfile(run / "checkpoint_00000004" / f, torn / f)

    resumed = pretrain(ray_address, args + ["--resume", "auto"])
    assert "skipping checkpoint" in resumed.stdout and "checkpoint_00000008 is incomplete" in resumed.stdout
    assert f"resumed run {name} at optimizer step 4 " in resumed.stdout
    assert sorted(f.name for f in torn.iterdir()) == ["COMPLETE.json", "scaler.pt"]  # step 8 redone elsewhere
    steps = metric_steps(run)
    assert steps == sorted(set(steps)) and steps[-1] == STEPS
    assert bitwise_equal(final_weights(run_storage, name), baseline["weights"])
