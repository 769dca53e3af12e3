"""SIGTERM (preemption: Kubernetes, a spot reclaim) to a Ray worker: every rank checkpoints at the step they agree
on, the worker group exits, and the restart (--max-failures) redoes no step."""

from __future__ import annotations

import signal
import time

import pytest
from inprocess import configs
from reference import check_run, replay
from runs import (
    STEPS,
    bitwise_equal,
    final_weights,
    metrics,
    ray_train_workers,
    start_pretrain,
    tiny_args,
    wait_for,
)

from minilm.distributed import AGREEMENT_DELAY

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


@pytest.mark.slow
def test_sigterm_to_a_worker_checkpoints_at_the_agreed_step(ray_address, run_data, run_storage, baseline, tmp_path):
    name, ids, hold = "sigterm", tmp_path / "ids", tmp_path / "hold"
    hold.touch()  # both ranks wait after their first step
    args = tiny_args(run_data, run_storage, name, "--num-workers", "2", "--max-failures", "1")
    proc = start_pretrain(ray_address, args, capture=True, MINILM_TEST_HOLD_FILE=str(hold),
                          MINILM_TEST_RECORD_SAMPLE_IDS=str(ids))
    held = [tmp_path / f"hold.rank{r}" for r in (0, 1)]
    wait_for(lambda: all(h.is_file() for h in held), proc, "both ranks were held")
    step = int(held[1].read_text())
    workers = ray_train_workers()
    assert len(workers) == 2
    workers[-1].send_signal(signal.SIGTERM)
    time.sleep(1.0)  # the flag is set before the ranks move on
    hold.unlink()
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    expected = step + AGREEMENT_DELAY  # raised after step `step`, agreed by both ranks AGREEMENT_DELAY steps later
    assert f"SIGTERM at optimizer step {expected}: checkpoint written, exiting for a restart" in out, out[-3000:]
    assert f"resumed run {name} at optimizer step {expected} " in out  # nothing redone
    assert "preempt" in (run_storage / name / "world_size.csv").read_text()
    assert bitwise_equal(final_weights(run_storage, name), baseline["weights"])
    check_run(replay(*configs(), run_data, ids, STEPS), final_weights(run_storage, name), metrics(run_storage / name))
