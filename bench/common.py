"""Shared helpers for the benchmarks: a measured matmul peak, environment facts, JSON output."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def matmul_peak_flops(dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 10) -> float:
    """Best-of-`repeats` FLOP/s of an n x n @ n x n matmul in this process: the denominator of MFU.

    Measured rather than taken from a data sheet, so MFU says how well the step uses the matmul
    throughput this machine (and this torch build, with its current thread count) really reaches.
    """
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    a @ b  # warm-up: thread pool, kernel selection
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def environment() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version()}


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
