"""What the Ray job sets for Ray and for torch so a run is not slowed by Ray's defaults (no Ray started here)."""

from __future__ import annotations

import pytest
import torch

from ray_jobs.cli import RayOptions as RunOptions

POLL = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"


@pytest.mark.parametrize("users", [None, "1.5"])
def test_the_train_controller_polls_every_tenth_of_a_second_unless_the_user_set_it(monkeypatch, tmp_path, users):
    """Ray Train's controller takes one report per worker per poll (2 s by default) and a report made sooner blocks
    until then; the job asks for 0.1 s, which Ray hands from the process that calls fit() to the controller. A poll
    interval the user set wins."""
    from ray.train.v2._internal.constants import get_env_vars_to_propagate

    from ray_jobs.pretrain import make_trainer

    monkeypatch.setenv(POLL, users or "")  # recorded, so the value the job sets is undone after the test
    if users is None:
        monkeypatch.delenv(POLL)
        assert POLL not in get_env_vars_to_propagate()
    make_trainer({}, RunOptions(use_gpu="false", cpus_per_worker=1.0, storage_path=str(tmp_path), name="poll",
                                num_workers="1"))
    assert get_env_vars_to_propagate()[POLL] == (users or "0.1")


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


def auto(monkeypatch, nodes: list[dict], workers: int, gpu: bool = False, reserved: float = 0.0) -> float:
    import ray

    from ray_jobs import pretrain

    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": r} for r in nodes])
    monkeypatch.setattr(pretrain, "uses_gpu", lambda opts: gpu)
    return pretrain.auto_cpus_per_worker(workers, False, RunOptions(), reserved)


@pytest.mark.parametrize(("cores", "workers", "expected"), [(2, 1, 2.0), (2, 2, 1.0), (2, 3, 1.0), (16, 4, 4.0)])
def test_auto_cpus_on_a_local_ray_share_the_cores(monkeypatch, cores, workers, expected):
    from ray_jobs import pretrain

    monkeypatch.setattr(pretrain, "available_cores", lambda: cores)
    assert pretrain.auto_cpus_per_worker(workers, True, RunOptions()) == expected


@pytest.mark.parametrize("nodes, workers, gpu, reserved, expected", [
    # on a cluster, one CPU per node left for Ray Data
    ([{"CPU": 8}], 1, False, 0.0, 7.0),
    ([{"CPU": 8}], 2, False, 0.0, 3.0),
    ([{"CPU": 8}, {"CPU": 16}], 4, False, 0.0, 3.0),  # 2 a node, the smaller node decides
    ([{"CPU": 2}], 4, False, 0.0, 1.0),  # at least one
    # room for Tune's trial actors: a 1-worker trial on an 8-CPU node took 7 CPUs for the worker plus the trial's
    # 0.1, which left Ray Data 0.9 CPUs, less than one task needs (the sweep hung at step 0)
    ([{"CPU": 8}], 1, False, 0.1, 6.0),
    ([{"CPU": 8}], 2, False, 0.2, 3.0),
    # on GPU nodes, the CPUs per GPU
    ([{"CPU": 96, "GPU": 8}], 16, True, 0.0, 11.0),
    ([{"CPU": 4, "GPU": 8}], 8, True, 0.0, 1.0),
])
def test_auto_cpus_on_a_cluster(monkeypatch, nodes, workers, gpu, reserved, expected):
    assert auto(monkeypatch, nodes, workers, gpu, reserved) == expected


def test_cuda_nccl_and_torch_settings_reach_the_workers(monkeypatch):
    # On a running cluster the workers do not inherit the driver's shell: NCCL_*, TORCH_NCCL_*, TORCH_LOGS,
    # PYTORCH_CUDA_ALLOC_CONF and CUDA_LAUNCH_BLOCKING travel in the runtime env; Inductor's compile threads are
    # the worker's CPUs unless the user set them.
    from ray_jobs.pretrain import worker_env

    for k in list(__import__("os").environ):
        if k.startswith(("NCCL_", "TORCH_", "PYTORCH_", "CUDA_")):
            monkeypatch.delenv(k)
    settings = {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                "TORCH_LOGS": "recompiles", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                "CUDA_LAUNCH_BLOCKING": "1"}
    for k, v in settings.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # Ray's to set per worker, never the driver's
    env = worker_env(RunOptions(cpus_per_worker=4.0))
    assert {k: env[k] for k in settings} == settings and "CUDA_VISIBLE_DEVICES" not in env
    assert env["TORCHINDUCTOR_COMPILE_THREADS"] == "4" == env["OMP_NUM_THREADS"]
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "2")
    assert worker_env(RunOptions(cpus_per_worker=4.0))["TORCHINDUCTOR_COMPILE_THREADS"] == "2"
