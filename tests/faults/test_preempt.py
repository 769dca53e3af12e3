"""SIGTERM (preemption: Kubernetes, a spot reclaim) to a worker: a checkpoint at the next step boundary, then a
restart (--max-failures) that redoes no step."""

from __future__ import annotations

import re
import signal
import time

import pytest
from runs import bitwise_equal, final_weights, ray_train_workers, start_until_checkpoint, tiny_args

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


@pytest.mark.slow
def test_sigterm_to_a_worker_checkpoints_at_the_step_boundary(ray_address, run_data, run_storage, baseline):
    name = "sigterm"
    args = tiny_args(run_data, run_storage, name, "--num-workers", "2", "--max-failures", "1")
    proc = start_until_checkpoint(ray_address, args, run_storage / name / "checkpoint_00000004" / "COMPLETE.json",
                                  capture=True)
    time.sleep(1.0)  # mid-way between checkpoints
    workers = ray_train_workers()
    assert workers
    workers[-1].send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    stopped = re.search(r"SIGTERM at optimizer step (\d+): checkpoint written", out)
    assert stopped, out[-3000:]
    k = int(stopped.group(1))
    assert k % 4 != 0 or k > 4  # an extra checkpoint at the boundary, not the periodic one
    assert f"resumed run {name} at optimizer step {k} " in out  # nothing redone
    assert bitwise_equal(final_weights(run_storage, name), baseline["weights"])
