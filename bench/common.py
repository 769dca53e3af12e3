"""Shared helpers for the benchmarks. Results go to bench/results/, or to $MINILM_BENCH_RESULTS (the tests'
temporary folder)."""

from __future__ import annotations

import json
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def results_dir() -> Path:
    return Path(os.environ.get("MINILM_BENCH_RESULTS") or RESULTS)


def synchronize(device: torch.device | str = "cpu") -> None:
    """Wait for queued GPU work, so a wall-clock interval covers it; nothing to wait for on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def alternate(steps: dict[str, Callable[[int], object]], timed: int, warmup: int,
              device: torch.device | str = "cpu") -> dict[str, list[float]]:
    """Time `steps[name](i)` for each name in turn, round after round, after `warmup` rounds. Round-robin, so
    background load hits every configuration alike and their ratio holds when absolute times drift."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(warmup + timed):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step(i)
            synchronize(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


MODEL_ARGS = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
              "vocab_size": 6400, "seq_len": 256, "micro_batch_size": 8}  # issue #7's reference config


def add_model_args(p, keys=tuple(MODEL_ARGS), helps: dict | None = None, **defaults) -> None:
    """The model and batch flags of `keys`, defaults from `defaults`, else MODEL_ARGS."""
    for key in keys:
        p.add_argument("--" + key.replace("_", "-"), type=int, default=defaults.get(key, MODEL_ARGS.get(key)),
                       help=(helps or {}).get(key))


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def environment() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    env = {"cpu": cpu, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "torch": torch.__version__, "python": platform.python_version(), "load_average": load_average(),
           "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def write_json(name: str, payload: dict) -> Path:
    directory = results_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def memory(pid: int | None = None) -> dict:
    """RSS, its peak (hwm) and its parts from /proc/PID/status, in bytes: anon is private memory, shmem shared
    memory mapped (Ray's object store), file mapped files (libraries)."""
    out = {}
    with open(f"/proc/{pid or os.getpid()}/status") as f:
        for line in f:
            for key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                if line.startswith(key + ":"):
                    out[key.removeprefix("Vm").removeprefix("Rss").lower()] = int(line.split()[1]) * 1024
    return out


class Sampler:
    """`sample()` every `interval` seconds in a thread while in the `with` block: `samples`, (time, value) pairs."""

    def __init__(self, sample: Callable[[], object], interval: float):
        self.sample, self.interval = sample, interval
        self.samples: list[tuple[float, object]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self.sample()))
            self._stop.wait(self.interval)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
