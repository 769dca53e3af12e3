"""SIGTERM to one worker, SIGKILL of one worker, then SIGKILL of the driver, in one run: Ray's own recovery paths.

SIGTERM (preemption: Kubernetes, a spot reclaim): every rank checkpoints at the step they agree on, the worker group
exits, and the restart (--max-failures) redoes no step. SIGKILL of a worker: the restart continues the newest
complete checkpoint. SIGKILL of the driver: `--resume auto` continues. The run finishes with final fp32 weights
bitwise equal to the uninterrupted `baseline` run (same world size), and with the weights, lrs and losses of the
independent replay (tests/reference.py). A kill while a checkpoint is written: tests/test_trainer.py.
"""

from __future__ import annotations

import signal
import time

import pytest
from helpers import bitwise_equal, metrics, wait_for
from inprocess import configs
from reference import check_run, replay
from runs import (
    STEPS,
    final_weights,
    is_complete,
    metric_steps,
    pretrain,
    ray_train_workers,
    start_pretrain,
    timeline,
    tiny_args,
    wait_until_workers_exit,
)

from minilm.distributed import AGREEMENT_DELAY

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


@pytest.mark.slow
def test_sigterm_then_a_killed_worker_then_a_killed_driver_each_resume_to_the_uninterrupted_weights(
        ray_address, run_data, run_storage, baseline, tmp_path):
    """1. SIGTERM to a worker while both ranks are held after their first step: the checkpoint is at the step the
    ranks agree on (AGREEMENT_DELAY steps later), and the restart, within the run, redoes nothing.
    2. A worker SIGKILLed once checkpoint 8 is written: `--max-failures` restarts the group from the newest complete
    checkpoint. 3. The driver SIGKILLed the moment checkpoint 16 is complete in storage: Ray Train registers a
    checkpoint only once every rank's report reached its controller, so it usually has not yet, and `--resume auto`
    must continue checkpoint 16 from the run folder all the same, not start fresh."""
    name, ids, hold = "kills", tmp_path / "ids", tmp_path / "hold"
    run_dir = run_storage / name
    args = tiny_args(run_data, run_storage, name, "--num-workers", "2", "--max-failures", "2")
    hold.touch()  # both ranks wait after their first step
    log = tmp_path / "driver.log"
    proc = start_pretrain(ray_address, args, capture=False, log=log, MINILM_TEST_HOLD_FILE=str(hold),
                          MINILM_TEST_STEP_DELAY_S="0.5", MINILM_TEST_RECORD_SAMPLE_IDS=str(ids))
    held = [tmp_path / f"hold.rank{r}" for r in (0, 1)]
    wait_for(lambda: all(h.is_file() for h in held), proc, "both ranks were held")
    step = int(held[1].read_text())
    workers = ray_train_workers()
    assert len(workers) == 2
    workers[-1].send_signal(signal.SIGTERM)
    time.sleep(1.0)  # the flag is set before the ranks move on
    hold.unlink()
    agreed = step + AGREEMENT_DELAY  # raised after step `step`, agreed by both ranks AGREEMENT_DELAY steps later
    wait_for(lambda: [r["event"] for r in timeline(run_dir)] == ["start", "preempt", "restart"], proc,
             "the restart after SIGTERM")

    wait_for(lambda: is_complete(run_dir / "checkpoint_00000008"), proc, "checkpoint 8 was complete in storage")
    workers = ray_train_workers()  # checkpoint 4 is surely registered with Ray once checkpoint 8 is written
    assert workers, "no Ray Train worker process found"
    workers[-1].send_signal(signal.SIGKILL)  # the newest: one of the restarted group
    wait_for(lambda: len(timeline(run_dir)) == 4, proc, "the restart after the worker's SIGKILL")

    wait_for(lambda: is_complete(run_dir / "checkpoint_00000016"), proc, "checkpoint 16 was complete in storage",
             poll=0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    wait_until_workers_exit()
    assert not (run_dir / f"checkpoint_{STEPS:08d}").exists()  # the driver died mid-run
    out = log.read_text()
    assert f"SIGTERM at optimizer step {agreed}: checkpoint written, exiting for a restart" in out, out[-3000:]
    assert f"resumed run {name} at optimizer step {agreed} " in out  # nothing redone

    resumed = pretrain(ray_address, args + ["--resume", "auto"], MINILM_TEST_RECORD_SAMPLE_IDS=str(ids))
    assert f"resumed run {name} at optimizer step 16 " in resumed.stdout
    assert f"step {STEPS}/{STEPS}" in resumed.stdout
    rows = timeline(run_dir)
    assert [(r["event"], r["optimizer_step"]) for r in rows[:3]] == [
        ("start", 0), ("preempt", agreed), ("restart", agreed)], rows
    assert rows[2]["redone_steps"] == 0  # the SIGTERM checkpoint is the step the ranks stopped at
    assert [r["event"] for r in rows[3:]] == ["restart", "restart", "finish"], rows
    assert rows[3]["optimizer_step"] in (4, 8) and rows[4]["optimizer_step"] == 16, rows
    steps = metric_steps(run_dir)
    assert steps == sorted(set(steps))  # redone steps replaced, not appended
    assert bitwise_equal(final_weights(run_storage, name), baseline["weights"])
    check_run(replay(*configs(), run_data, ids, STEPS), final_weights(run_storage, name), metrics(run_dir))
