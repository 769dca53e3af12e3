"""SIGKILL of the driver, and of one worker: Ray's own recovery paths.

Each run finishes, by `--resume auto` or by a `--max-failures` restart, with final fp32 weights bitwise
equal to the uninterrupted `baseline` run (same world size), and with the weights, lrs and losses of the
independent replay (tests/reference.py). A kill while a checkpoint is written: tests/test_trainer.py.
"""

from __future__ import annotations

import signal

import pytest
from inprocess import configs
from reference import check_run, replay
from runs import (
    STEPS,
    bitwise_equal,
    final_weights,
    is_complete,
    metric_steps,
    metrics,
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
def test_driver_killed_then_resume_auto_is_bitwise_equal(ray_address, run_data, run_storage, baseline, tmp_path):
    """The driver dies the moment checkpoint 4 is complete in storage. Ray Train registers a checkpoint
    only once every rank's report reached its controller, so it usually has not yet: the resumed run
    must continue checkpoint 4 from the run folder all the same, not start fresh."""
    name, ids = "killed", tmp_path / "ids"
    args = tiny_args(run_data, run_storage, name, "--num-workers", "2")
    first = run_storage / name / "checkpoint_00000004"
    proc = start_pretrain(ray_address, args, capture=False, MINILM_TEST_STEP_DELAY_S="1.0",  # 4 s to checkpoint 8
                          MINILM_TEST_RECORD_SAMPLE_IDS=str(ids))
    wait_for(lambda: is_complete(first), proc, "checkpoint 4 was complete in storage", poll=0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    wait_until_workers_exit()
    assert not (run_storage / name / "checkpoint_00000008").exists()
    resumed = pretrain(ray_address, args + ["--resume", "auto"], MINILM_TEST_RECORD_SAMPLE_IDS=str(ids))
    assert f"resumed run {name} at optimizer step 4 " in resumed.stdout
    assert bitwise_equal(final_weights(run_storage, name), baseline["weights"])
    check_run(replay(*configs(), run_data, ids, STEPS), final_weights(run_storage, name), metrics(run_storage / name))


@pytest.mark.slow
def test_sigkilled_worker_recovers_with_max_failures(ray_address, run_data, run_storage, baseline, tmp_path):
    name, ids = "workerkill", tmp_path / "ids"
    args = tiny_args(run_data, run_storage, name, "--num-workers", "2", "--max-failures", "1")
    # checkpoint 4 is surely registered with Ray once checkpoint 8 is written
    proc = start_until_checkpoint(ray_address, args, run_storage / name / "checkpoint_00000008" / "COMPLETE.json",
                                  capture=True, MINILM_TEST_RECORD_SAMPLE_IDS=str(ids))
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
    check_run(replay(*configs(), run_data, ids, STEPS), final_weights(run_storage, name), metrics(run_storage / name))
