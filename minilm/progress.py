"""Progress a person can follow: the log line, metrics.jsonl, throughput and MFU."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

# Dense bf16 peak FLOP/s of common accelerators (no sparsity), for MFU on GPUs.
GPU_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "A10G": 125e12, "L4": 121e12, "L40S": 362e12,
                 "V100": 125e12, "T4": 65e12, "4090": 165e12, "3090": 71e12}


def measured_matmul_peak(dtype: torch.dtype = torch.float32, size: int = 1024, repeats: int = 5,
                         device: str = "cpu") -> float:
    """FLOP/s of the best of a few square matmuls: the reference for MFU on a CPU (or unknown GPU)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in GPU_PEAK_BF16.items():
            if key in name:
                return flops if dtype != torch.float32 else flops / 2
        return measured_matmul_peak(dtype, 4096, device=str(device))
    return measured_matmul_peak(dtype)


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def format_log_line(m: dict) -> str:
    """MiniMind-style: one line per log interval on rank 0."""
    line = (f"epoch {m['epoch'] + 1}/{m['epochs']} step {m['optimizer_step']}/{m['total_steps']} "
            f"loss {m['loss']:.4f} (lm {m['lm_loss']:.4f} aux {m['aux_loss']:.4f}) lr {m['lr']:.3e} "
            f"grad_norm {m['grad_norm']:.3f} tokens/s {m['tokens_per_s']:,.0f} mfu {100 * m['mfu']:.1f}% "
            f"world {m['world_size']}x{m['accumulation_steps']} eta {format_duration(m['eta_s'])}")
    if m.get("skipped_steps"):
        line += f" skipped {m['skipped_steps']}"
    if "val_loss" in m:
        line += f" val_loss {m['val_loss']:.4f}"
    loads = m.get("expert_load")
    if loads:
        line += " expert_load " + " | ".join("/".join(f"{x:.2f}" for x in layer) for layer in loads)
    return line


class MetricsLog:
    """Append-only metrics.jsonl in the run folder, one record per reported step.

    On resume, records past the resumed optimizer step (steps that will be redone) are dropped, so
    the file's step axis never goes backwards.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def truncate_after(self, optimizer_step: int) -> int:
        if not self.path.is_file():
            return 0
        kept, dropped = [], 0
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1  # a torn last line from a killed process
                continue
            if rec.get("optimizer_step", 0) <= optimizer_step:
                kept.append(line)
            else:
                dropped += 1
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(k + "\n" for k in kept))
        os.replace(tmp, self.path)
        return dropped

    def append(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
