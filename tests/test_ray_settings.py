"""What the Ray job sets for Ray and for torch so a run is not slowed by Ray's defaults (no Ray started here)."""

from __future__ import annotations

import pytest
import torch

POLL = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"


def build(tmp_path):
    from ray_jobs.pretrain import RUN_DEFAULTS, make_trainer

    opts = {**RUN_DEFAULTS, "use_gpu": "false", "cpus_per_worker": 1.0, "resources_per_worker": {}}
    return make_trainer({}, opts, str(tmp_path), "poll", (1, 1))


def test_the_train_controller_polls_every_tenth_of_a_second(monkeypatch, tmp_path):
    """Ray Train's controller takes one report per worker per poll (2 s by default) and a report made sooner blocks
    until then; the job asks for 0.1 s, which Ray hands from the process that calls fit() to the controller."""
    from ray.train.v2._internal.constants import get_env_vars_to_propagate

    monkeypatch.setenv(POLL, "")  # recorded, so the value the job sets is undone after the test
    monkeypatch.delenv(POLL)
    assert POLL not in get_env_vars_to_propagate()
    build(tmp_path)
    assert get_env_vars_to_propagate()[POLL] == "0.1"


def test_a_poll_interval_the_user_set_wins(monkeypatch, tmp_path):
    from ray.train.v2._internal.constants import get_env_vars_to_propagate

    monkeypatch.setenv(POLL, "1.5")
    build(tmp_path)
    assert get_env_vars_to_propagate()[POLL] == "1.5"


@pytest.mark.parametrize(("threads", "cores", "local_workers", "expected"),
                         [(3, 2, 2, 1), (3, 2, 1, 2), (1, 8, 2, 1), (4, 8, 2, 4), (8, 2, 4, 1)])
def test_worker_threads_stay_within_the_nodes_cores(monkeypatch, threads, cores, local_workers, expected):
    """--cpus-per-worker from a Ray whose logical CPUs overstate the cores (8 declared on 2 cores: 3 threads for each
    of 2 workers) is capped at the cores shared among the workers on the node; fewer threads are kept."""
    from ray_jobs import worker

    monkeypatch.setattr(worker, "available_cores", lambda: cores)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        worker.cap_threads(local_workers)
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)
