"""The CUDA rules the CPU path never meets, enforced on CPU by tests/cuda_standin.py: the stand-in refuses what a GPU
refuses, and the GPU check's parts that train on the device (trainer-ddp1, a row, the checkpoint stall) run
under it with --device cuda, as bench/gpu_check.sh runs them on the lent GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from cuda_standin import CudaRules, CudaViolation
from helpers import ROOT

pytestmark = pytest.mark.timeout(300)
TINY = ["--hidden-size", "64", "--num-hidden-layers", "2", "--vocab-size", "512", "--seq-len", "32",
        "--micro-batch-size", "4"]


def test_set_device_needs_an_index_as_on_a_gpu():
    # bench/gpu_check.py's parts ddp1 (since removed) and trainer-ddp1 once called torch.cuda.set_device(torch.device("cuda")): torch's
    # own check raises before any driver call, so the stand-in raises where a GPU run raised.
    with CudaRules() as rules:
        with pytest.raises(ValueError, match="Expected a torch.device with a specified index"):
            torch.cuda.set_device(torch.device("cuda"))
        torch.cuda.set_device(torch.device("cuda", 0))
        torch.cuda.set_device(0)
    assert rules.set_devices == [0, 0]


def test_ray_trains_get_device_is_indexed(monkeypatch):
    # ray_jobs/worker.py's RayLauncher sets ray.train.torch.get_device() current: Ray 2.60's CUDA device manager
    # returns cuda:<index>, which set_device takes. As in a Ray Train worker granted GPU 0; the real
    # ray.get_gpu_ids() would start a Ray in this process (one with this machine's 2 CPUs, which the session's
    # Ray fixture then joins and every 2-worker run deadlocks on).
    import ray
    from ray.air._internal.device_manager.nvidia_gpu import CUDATorchDeviceManager

    monkeypatch.setattr(ray, "get_gpu_ids", lambda: ["0"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with CudaRules() as rules:
        (device,) = CUDATorchDeviceManager().get_devices()
        torch.cuda.set_device(device)
    assert device == torch.device("cuda", 0) and rules.set_devices == [0]


def test_collectives_take_device_tensors_only(tmp_path):
    with CudaRules() as rules:
        dist.init_process_group("nccl", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
        try:
            on_device = torch.ones(3, device="cuda")
            dist.all_reduce(on_device)
            with pytest.raises(CudaViolation, match="NCCL refuses this all_reduce"):
                dist.all_reduce(torch.ones(3))  # a host tensor, as the old stop flags were
            with pytest.raises(CudaViolation, match="NCCL refuses this all_reduce"):
                dist.all_reduce(on_device.cpu())
        finally:
            dist.destroy_process_group()
    assert rules.backends == ["nccl"] and rules.collectives == [("all_reduce", True), ("all_reduce", False),
                                                                 ("all_reduce", False)]


def test_non_blocking_copies_need_pinned_host_memory():
    with CudaRules() as rules:
        host = torch.arange(4.0)
        with pytest.raises(CudaViolation, match="non-blocking host->device copy from pageable host memory"):
            host.to("cuda", non_blocking=True)
        on_device = host.pin_memory().to("cuda", non_blocking=True)
        host.to("cuda")  # a blocking copy needs nothing
        with pytest.raises(CudaViolation, match="non-blocking device->host copy from pageable host memory"):
            torch.empty(4).copy_(on_device, non_blocking=True)
        pinned = torch.empty(4, pin_memory=True)
        pinned.copy_(on_device, non_blocking=True)
        assert pinned.is_pinned() and not host.is_pinned()
        assert on_device.to("cpu", non_blocking=True).is_pinned()  # torch pins a non-blocking copy to the host
    assert [c[0] for c in rules.copies] == ["host->device", "host->device", "host->device", "device->host",
                                            "device->host", "device->host"]


def test_device_memory_is_counted_with_its_peak_and_a_limit_raises_as_on_a_gpu():
    with CudaRules(memory_limit=1000):
        on_device, host = torch.zeros(100, device="cuda"), torch.zeros(1000)  # 400 bytes on the device
        assert torch.cuda.memory_allocated() == 400 and torch.cuda.get_device_properties(0).total_memory == 1000
        doubled = on_device * 2
        on_device.view(10, 10).add_(1)  # a view and an in-place op allocate nothing
        del doubled
        assert (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()) == (400, 800)
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.max_memory_allocated() == 400
        with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
            on_device.repeat(2)  # 400 + 800 bytes
        assert torch.cuda.memory_allocated() == 400 and host.sum() == 0


def run_part(tmp_path, *args, allow: str = "") -> tuple[subprocess.CompletedProcess, dict]:
    """`python tests/cuda_standin.py -m bench.gpu_check ARGS`: a part in its own process, as the check runs it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "PYTHONUNBUFFERED": "1",
           "MINILM_BENCH_RESULTS": str(tmp_path / "results"), "CUDA_STANDIN_ALLOW": allow}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "cuda_standin.py"), "-m", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("cuda-standin: ")]
    return proc, json.loads(line[-1].split(": ", 1)[1]) if line else {}


def test_a_row_runs_under_the_cuda_rules(tmp_path):
    proc, rules = run_part(tmp_path, "bench.gpu_check", "row", "--name", "step-26m-eager", "--json",
                           str(tmp_path / "row.json"), "--device", "cuda", "--steps", "1", "--warmup", "1",
                           "--peak-size", "128", *TINY)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = json.loads((tmp_path / "row.json").read_text())
    assert row["peak_memory_of"] == "torch.cuda.max_memory_allocated"
    assert row["sdpa"]["gqa"] in ("sdpa", "repeat")  # "auto" timed on the device (minilm.model.resolve_gqa)


def test_trainer_ddp1_runs_under_the_cuda_rules(tmp_path):
    # The Trainer in a 1-rank NCCL group: its collectives on the device (metric means, the per-step flag agreement
    # through pinned memory), its final checkpoint's snapshot into pinned buffers, its batches copied to the device
    # non-blocking from pinned memory (minilm/data/store.py's LocalRankStream pins them on CUDA).
    proc, rules = run_part(tmp_path, "bench.gpu_check", "trainer-ddp1", "--device", "cuda", "--json",
                           str(tmp_path / "t.json"), *TINY, "--steps", "4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "t.json").read_text())
    assert result["backend"] == "nccl" and result["runs"]["ddp"]["ddp"] and result["group_collectives"] > 0
    assert rules["set_devices"] == [0] and rules["backends"] == ["nccl"]
    assert rules["collectives"] and all(ok for _, ok in rules["collectives"])
    assert ["device->host", True, True] in rules["copies"]  # the snapshot and the flags, non-blocking into pinned
    assert ["host->device", True, False] not in rules["copies"]  # no non-blocking copy from pageable memory
    assert sum(c == ["host->device", True, True] for c in rules["copies"]) >= 2 * 4 * 2  # every micro-batch


def test_the_checkpoint_stall_runs_under_the_cuda_rules(tmp_path):
    proc, rules = run_part(tmp_path, "bench.checkpoint", "--device", "cuda", "--sizes", "64x2",
                           "--vocab-size", "512", "--seq-len", "32", "--repeats", "1", "--dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ["device->host", True, True] in rules["copies"]
