"""MFU's denominator: exact GPU names from the data-sheet table, a measured matmul peak for everything else."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from minilm import progress
from minilm.progress import GPU_PEAK_BF16, MetricsLog, measured_matmul_peak, peak_flops

CUDA = torch.device("cuda", 0)


@pytest.fixture
def measured(monkeypatch):
    """Replace the measurement with a recorder, so a fallback is visible (and needs no GPU)."""
    calls = []

    def fake(dtype=torch.float32, n=1024, repeats=5, device="cpu"):
        calls.append((dtype, torch.device(device)))
        return 1.5e12

    monkeypatch.setattr(progress, "measured_matmul_peak", fake)
    return calls


@pytest.mark.parametrize("name,bf16", [
    ("NVIDIA L4", 121e12),
    ("NVIDIA L40S", 362.05e12),  # substring matching gave it the L4's peak
    ("NVIDIA L40", 181.05e12),
    ("NVIDIA H100 80GB HBM3", 989.5e12),  # H100 SXM
    ("NVIDIA H100 PCIe", 756.5e12),  # not the SXM's
    ("NVIDIA H200", 989.5e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100-PCIE-40GB", 312e12),
])
def test_listed_gpus_get_their_data_sheet_peak(name, bf16, measured):
    assert peak_flops(CUDA, torch.bfloat16, device_name=name) == bf16
    assert peak_flops(CUDA, torch.float16, device_name=name) == bf16
    assert peak_flops(CUDA, torch.float32, device_name=name) == bf16 / 2  # TF32 tensor cores
    assert measured == []


@pytest.mark.parametrize("name", [
    "NVIDIA H100 NVL",  # unconfirmed figure: measured, not the SXM's
    "NVIDIA A100-SXM4-40GB MIG 1g.5gb",  # a slice has a fraction of the GPU's peak
    "Tesla V100-SXM2-16GB",  # pre-Ampere: no bf16 or TF32 tensor cores
    "NVIDIA A10G",
    "NVIDIA L4 ",  # exact names only
])
def test_unlisted_names_fall_back_to_a_measured_peak_on_that_device(name, measured):
    assert name not in GPU_PEAK_BF16
    assert peak_flops(CUDA, torch.bfloat16, device_name=name) == 1.5e12
    assert measured == [(torch.bfloat16, CUDA)]


def test_cpu_is_measured_and_never_asks_cuda(monkeypatch, measured):
    def no_cuda(*args, **kwargs):
        raise AssertionError("a CPU run asked for a CUDA device name")

    monkeypatch.setattr(torch.cuda, "get_device_name", no_cuda)
    assert peak_flops(torch.device("cpu"), torch.float32) == 1.5e12
    assert measured == [(torch.float32, torch.device("cpu"))]


def test_the_device_name_defaults_to_torch_s(monkeypatch, measured):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    assert peak_flops(CUDA, torch.bfloat16) == 362.05e12


def test_measured_peak_is_the_best_repeat(monkeypatch):
    # Repeats take 4, 2, 3 s (after the warm-up): the best, 2 s, counts.
    clock = itertools.chain([0.0, 4.0, 10.0, 12.0, 20.0, 23.0])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    assert measured_matmul_peak(torch.float32, n=64, repeats=3) == 2 * 64**3 / 2.0


def test_measured_peak_on_this_cpu_is_plausible():
    flops = measured_matmul_peak(torch.float32, n=256, repeats=3)
    assert 1e8 < flops < 1e14  # 0.1 GFLOP/s .. 100 TFLOP/s: a real measurement of a CPU, not a constant


def test_a_bf16_step_on_this_cpu_runs_below_its_measured_peak():
    # The peak is measured with the model's own op: on a CPU without bf16 units a bf16 `a @ b` runs ~20x slower than
    # F.linear, and MFU against it printed bf16 steps at 200-350%.
    from minilm.config import ModelConfig
    from minilm.model import MiniMindForCausalLM

    model = MiniMindForCausalLM(ModelConfig(hidden_size=128, num_hidden_layers=2, vocab_size=512))
    tokens = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens, labels=tokens).loss
        loss.backward()

    step()
    t0 = time.perf_counter()
    for _ in range(3):
        step()
    tokens_per_s = 3 * tokens.numel() / (time.perf_counter() - t0)
    mfu = model.estimate_mfu(tokens_per_s, 64, measured_matmul_peak(torch.bfloat16))
    assert 0 < mfu < 1, f"MFU {mfu:.0%}: the peak is below what the model's matmuls reach"


def test_metrics_log_drops_the_steps_to_be_redone_and_a_torn_line(tmp_path):
    log = MetricsLog(tmp_path / "run" / "metrics.jsonl")
    for step in (1, 2, 3):
        log.append({"optimizer_step": step, "loss": 1.0 / step})
    with open(log.path, "a") as f:
        f.write('{"optimizer_step": 4, "lo')  # a process killed mid-line
    assert [r["optimizer_step"] for r in log.read()] == [1, 2, 3]
    log.truncate_after(2)
    log.append({"optimizer_step": 3, "loss": 0.25})
    assert log.path.read_text() == ('{"loss": 1.0, "optimizer_step": 1}\n{"loss": 0.5, "optimizer_step": 2}\n'
                                    '{"loss": 0.25, "optimizer_step": 3}\n')


def test_a_run_measures_the_peak_once_after_its_first_log_interval(run_data, tmp_path, monkeypatch):
    """A run's start is busy (Ray's processes, the data pipeline): the peak measured then was low enough to print
    MFU over 100%. It is measured once, at the first log, after that interval's steps."""
    from inprocess import run_local

    import minilm.trainer as T

    ids, steps_done = tmp_path / "ids", []
    monkeypatch.setattr(T, "peak_flops", lambda device, dtype: steps_done.append(
        len((ids / "rank0.jsonl").read_text().splitlines())) or 1e12)
    run_local(run_data, tmp_path / "run", record=ids, max_steps=8, log_every=4, checkpoint_every=8)
    assert steps_done == [4]
