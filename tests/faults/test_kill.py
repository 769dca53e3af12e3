"""SIGKILL of one worker, then of the driver, in one run: Ray's own recovery paths.

The run finishes, through a `--max-failures` restart and then `--resume auto`, with final fp32 weights bitwise
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
    start_until_checkpoint,
    tiny_args,
    wait_for,
    wait_until_workers_exit,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


@pytest.mark.slow
def test_a_killed_worker_then_a_killed_driver_each_resume_to_the_uninterrupted_weights(ray_address, run_data, run_storage,
                                                                                      baseline, tmp_path):
    """Both of Ray's recovery paths in one run. A worker SIGKILLed once checkpoint 8 is written: `--max-failures 1`
    restarts the worker group within the run, from the newest complete checkpoint. Then the driver SIGKILLed the
    moment checkpoint 16 (written after that restart) is complete in storage: Ray Train registers a checkpoint only
    once every rank's report reached its controller, so it usually has not yet, and `--resume auto` must continue
    checkpoint 16 from the run folder all the same, not start fresh. The final weights equal the uninterrupted run's
    bit for bit, and the independent replay's."""
    name, ids = "kills", tmp_path / "ids"
    run_dir = run_storage / name
    args = tiny_args(run_data, run_storage, name, "--num-workers", "2", "--max-failures", "1")
    # checkpoint 4 is surely registered with Ray once checkpoint 8 is written
    proc = start_until_checkpoint(ray_address, args, run_dir / "checkpoint_00000008" / "COMPLETE.json",
                                  capture=False, MINILM_TEST_RECORD_SAMPLE_IDS=str(ids))
    workers = ray_train_workers()
    assert workers, "no Ray Train worker process found"
    workers[0].send_signal(signal.SIGKILL)
    wait_for(lambda: [r["event"] for r in timeline(run_dir)][-1:] == ["restart"], proc,
             "the worker group restarted within the run")
    wait_for(lambda: is_complete(run_dir / "checkpoint_00000016"), proc, "checkpoint 16 was complete in storage",
             poll=0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    wait_until_workers_exit()
    assert not (run_dir / f"checkpoint_{STEPS:08d}").exists()  # the driver died mid-run

    resumed = pretrain(ray_address, args + ["--resume", "auto"], MINILM_TEST_RECORD_SAMPLE_IDS=str(ids))
    assert f"resumed run {name} at optimizer step 16 " in resumed.stdout
    assert f"step {STEPS}/{STEPS}" in resumed.stdout
    events = timeline(run_dir)
    assert [r["event"] for r in events] == ["start", "restart", "restart", "finish"], events
    assert int(events[1]["optimizer_step"]) in (4, 8) and int(events[2]["optimizer_step"]) == 16, events
    steps = metric_steps(run_dir)
    assert steps == sorted(set(steps))  # redone steps replaced, not appended
    assert bitwise_equal(final_weights(run_storage, name), baseline["weights"])
    check_run(replay(*configs(), run_data, ids, STEPS), final_weights(run_storage, name), metrics(run_dir))


def timeline(run_dir) -> list[dict]:
    import csv

    path = run_dir / "world_size.csv"
    return list(csv.DictReader(path.open())) if path.is_file() else []
