"""A CUDA run's memory: the peak allocated and reserved since the previous metrics record in each record, the log
line and the dashboard's gauges (on a CPU: no fields); expandable segments in every training process's environment,
unless the user set the allocator's settings."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import torch
from inprocess import configs

from minilm import train
from minilm.progress import format_log_line
from minilm.step import CUDA_ALLOC_CONF
from minilm.train import LocalLauncher
from minilm.trainer import Dataset, RunOptions, Trainer
from ray_jobs import dashboard_metrics

PEAKS = ("cuda_peak_allocated_gib", "cuda_peak_reserved_gib")


@pytest.fixture
def cuda_peaks(monkeypatch):
    """torch.cuda's peak counters as a fake GPU's: each record's window peaks at 1.5 GiB allocated and 2 GiB
    reserved, plus 1 GiB per earlier reset (a reset that never came would show as the same value)."""
    resets = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: (1.5 + len(resets)) * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: (2 + len(resets)) * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")  # MFU's peak
    return resets


def fit_as_on(device: str, tmp_path) -> tuple[list[dict], list[str]]:
    """A 2-step Trainer on this CPU whose records are made as on `device`: (metrics.jsonl, log lines)."""
    model_cfg, train_cfg = configs(max_steps=2, warmup_steps=0, log_every=1, checkpoint_every=2)
    data = Dataset.in_memory(np.random.default_rng(0).integers(0, 256, (16, train_cfg.seq_len + 1)))
    lines = []
    launcher = LocalLauncher(data, train_cfg.micro_batch_size, run_dir=tmp_path, say=lines.append)
    trainer = Trainer(model_cfg, train_cfg, RunOptions(name="run", run_dir=str(tmp_path)), data, launcher)
    trainer.device = torch.device(device)  # what step_metrics reads
    trainer.fit()
    trainer.close("finished")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return records, [line for line in lines if line.startswith("epoch ")]


def test_each_cuda_record_and_log_line_has_the_peaks_since_the_previous_record(cuda_peaks, tmp_path):
    records, lines = fit_as_on("cuda", tmp_path)
    assert [(r["cuda_peak_allocated_gib"], r["cuda_peak_reserved_gib"]) for r in records] == [(1.5, 2.0), (2.5, 3.0)]
    assert [str(d) for d in cuda_peaks] == ["cuda", "cuda"]  # the peaks start over after each record
    assert [" cuda_peak 1.50/2.00 GiB" in lines[0], " cuda_peak 2.50/3.00 GiB" in lines[1]] == [True, True], lines


def test_a_cpu_record_and_log_line_have_no_peaks(cuda_peaks, tmp_path):
    records, lines = fit_as_on("cpu", tmp_path)
    assert len(records) == 2 and not any(k in r for r in records for k in PEAKS)
    assert cuda_peaks == [] and not any("cuda_peak" in line for line in lines)


def test_the_dashboard_exports_the_peaks_under_the_records_names():
    assert set(PEAKS) <= set(dashboard_metrics.GAUGES)
    line = format_log_line({"epoch": 0, "epochs": 1, "optimizer_step": 1, "total_steps": 2, "loss": 1.0, "lm_loss": 1.0,
                            "aux_loss": 0.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0, "mfu": 0.5,
                            "world_size": 1, "accumulation_steps": 1, "eta_s": 1.0,
                            "cuda_peak_allocated_gib": 10.123, "cuda_peak_reserved_gib": 12.0})
    assert line.endswith(" cuda_peak 10.12/12.00 GiB")


@pytest.fixture
def no_allocator_settings(monkeypatch):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(name, "")  # recorded first: what a start sets is undone too (delenv alone records
        monkeypatch.delenv(name)      # nothing for a variable that is not there)


def test_a_ray_gpu_workers_env_has_expandable_segments_and_keeps_the_users_setting(no_allocator_settings,
                                                                                     monkeypatch):
    from ray_jobs.cli import RayOptions
    from ray_jobs.pretrain import worker_env

    opts = RayOptions(cpus_per_worker=2.0)
    assert worker_env(opts, use_gpu=True)["PYTORCH_CUDA_ALLOC_CONF"] == CUDA_ALLOC_CONF == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in worker_env(opts, use_gpu=False)  # CPU workers: nothing to set
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        with monkeypatch.context() as m:
            m.setenv(name, "max_split_size_mb:128")
            env = worker_env(opts, use_gpu=True)
            assert env[name] == "max_split_size_mb:128", name
            assert {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & env.keys() == {name}


class Stop(Exception):
    pass


def test_a_cuda_train_process_sets_expandable_segments_before_its_checks_unless_the_user_set_one(
        no_allocator_settings, monkeypatch):
    """minilm.train (each torchrun rank) sets it first thing: its checks may start CUDA (--dtype auto's probe)."""
    seen = []

    def check_run(*_):
        seen.append(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        raise Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(train, "check_run", check_run)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # the start's SIGTERM handler stays out of this process
    with pytest.raises(Stop):
        train.start(["--max-steps", "1"])
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    with pytest.raises(Stop):
        train.start(["--max-steps", "1"])
    assert seen == ["expandable_segments:True", "max_split_size_mb:128"]
