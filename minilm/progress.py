"""Progress a person can follow: the log line, metrics.jsonl, throughput and MFU."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .fsio import append_jsonl, read_jsonl, write_atomic

# Dense bf16 tensor-core peak FLOP/s (fp32 accumulation) from NVIDIA's data sheets, keyed by the exact name
# torch.cuda.get_device_name() reports (an L40S is not an L4); Ampere and later only. An unlisted name (an older
# GPU, a MIG slice, a figure not checked) gets a measured matmul peak instead.
GPU_PEAK_BF16 = {
    "NVIDIA H100 80GB HBM3": 989.5e12,  # H100 SXM5
    "NVIDIA H100 PCIe": 756.5e12,
    "NVIDIA H200": 989.5e12,  # H200 SXM
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A10": 125e12,
    "NVIDIA L4": 121e12,
    "NVIDIA L40": 181.05e12,
    "NVIDIA L40S": 362.05e12,
    "NVIDIA GeForce RTX 4090": 165.2e12,
    "NVIDIA GeForce RTX 3090": 71e12,
}


def measured_matmul_peak(dtype: torch.dtype = torch.float32, n: int = 1024, repeats: int = 5,
                         device: torch.device | str = "cpu") -> float:
    """Best-of-`repeats` FLOP/s of an n x n matmul in `dtype` on `device`: MFU's reference where no data sheet
    applies. It is `F.linear`, the model's own op: on a CPU without bf16 units a bf16 `a @ b` takes a path ~20x
    slower than the one `F.linear` takes. On a GPU each repeat runs it 10 times between synchronisations, so launch
    latency does not count."""
    device = torch.device(device)
    a, b = torch.randn(2, n, n, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    cuda = device.type == "cuda"
    inner = 10 if cuda else 1
    F.linear(a, b)  # warm-up: thread pool, kernel selection
    if cuda:
        torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            F.linear(a, b)
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - t0) / inner)
    return 2 * n**3 / best


def datasheet_peak(device_name: str, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of the GPU named `device_name` in `dtype` (None: not listed); fp32 runs in TF32, at half
    the 16-bit rate (minilm.step.configure_backends turns it on)."""
    peak = GPU_PEAK_BF16.get(device_name)
    return peak / 2 if peak is not None and dtype == torch.float32 else peak


def peak_flops(device: torch.device, dtype: torch.dtype, device_name: str | None = None) -> float:
    """MFU's denominator: a listed GPU's data-sheet peak, else a matmul peak measured on `device`."""
    if device.type != "cuda":
        return measured_matmul_peak(dtype, device=device)
    peak = datasheet_peak(device_name if device_name is not None else torch.cuda.get_device_name(device), dtype)
    return peak if peak is not None else measured_matmul_peak(dtype, n=4096, device=device)


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def cuda_peak_memory(device: torch.device) -> dict[str, float]:
    """On a CUDA device, the most memory allocated and reserved since the previous call (or the start), in GiB; the
    peaks then start over. Elsewhere, nothing."""
    if device.type != "cuda":
        return {}
    peaks = {"cuda_peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
             "cuda_peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    torch.cuda.reset_peak_memory_stats(device)
    return peaks


def format_log_line(m: dict) -> str:
    """MiniMind-style: one line per log interval on rank 0."""
    line = (f"epoch {m['epoch'] + 1}/{m['epochs']} step {m['optimizer_step']}/{m['total_steps']} "
            f"loss {m['loss']:.4f} (lm {m['lm_loss']:.4f} aux {m['aux_loss']:.4f}) lr {m['lr']:.3e} "
            f"grad_norm {m['grad_norm']:.3f} tokens/s {m['tokens_per_s']:,.0f} mfu {100 * m['mfu']:.1f}% "
            f"world {m['world_size']}x{m['accumulation_steps']} eta {format_duration(m['eta_s'])}")
    if "cuda_peak_allocated_gib" in m:
        line += f" cuda_peak {m['cuda_peak_allocated_gib']:.2f}/{m['cuda_peak_reserved_gib']:.2f} GiB"
    if m.get("skipped_steps"):
        line += f" skipped {m['skipped_steps']}"
    line += "".join(f" {k} {m[k]:.4f}" for k in ("val_loss", "val_bpb") if k in m)
    loads = m.get("expert_load")
    if loads:
        line += " expert_load " + " | ".join("/".join(f"{x:.2f}" for x in layer) for layer in loads)
    return line


class MetricsLog:
    """Append-only metrics.jsonl, one record per reported step; on resume the records of steps to be redone are
    dropped, so its step axis never goes backwards."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def truncate_after(self, optimizer_step: int) -> None:
        if not self.path.is_file():
            return
        # A torn last line from a killed process, or a line that is not a record, goes too.
        kept = [json.dumps(r, sort_keys=True) for r in self.read()
                if isinstance(r, dict) and r.get("optimizer_step", 0) <= optimizer_step]
        write_atomic(self.path, "".join(k + "\n" for k in kept))

    def append(self, record: dict) -> None:
        append_jsonl(self.path, [record], sort_keys=True)

    def read(self) -> list[dict]:
        return read_jsonl(self.path)[0]


class Meter:
    """Throughput, data wait and ETA over each log interval; the loop restarts the interval after a log step's
    evaluation and checkpoint, so their time never counts as training time. `mfu(tokens_per_s)` is the model's."""

    def __init__(self, start_step: int, total_steps: int, data_wait_s: float, mfu):
        self.start_step, self.total_steps, self.mfu = start_step, total_steps, mfu
        self.t_start = time.perf_counter()
        self.restart(data_wait_s)

    def restart(self, data_wait_s: float) -> None:
        self.t_mark, self.tokens, self.wait_mark = time.perf_counter(), 0, data_wait_s

    def rates(self, step: int, data_wait_s: float) -> dict:
        now = time.perf_counter()
        elapsed = max(now - self.t_mark, 1e-9)
        tokens_per_s = self.tokens / elapsed
        return {"tokens_per_s": tokens_per_s, "mfu": self.mfu(tokens_per_s),
                "data_wait_frac": (data_wait_s - self.wait_mark) / elapsed,
                "eta_s": (now - self.t_start) / max(1, step - self.start_step) * (self.total_steps - step)}
