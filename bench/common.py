"""Shared helpers for the benchmarks: the model flags and the model they make, round-robin timing, the machine,
process memory, tables, a run's metrics. Results go to bench/results/, or to
$MINILM_BENCH_RESULTS (the tests' temporary folder)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
MODEL_ARGS = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
              "vocab_size": 6400, "seq_len": 256, "micro_batch_size": 8}  # issue #7's reference config


def results_dir() -> Path:
    return Path(os.environ.get("MINILM_BENCH_RESULTS") or RESULTS)


def write_json(name: str, payload: dict) -> Path:
    """`payload` as results_dir()/name; prints where."""
    write_atomic(path := results_dir() / name, json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return path


def write_atomic(path: Path | str, data: str | bytes) -> None:
    """Whole or not at all: the GPU check reads a part's file the moment it appears."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


def add_model_args(p, keys=tuple(MODEL_ARGS), **defaults) -> None:
    """Integer flags (the model's and the batch's by default): `keys`, defaults from `defaults`, else MODEL_ARGS."""
    for key in keys:
        p.add_argument("--" + key.replace("_", "-"), type=int, default=defaults.get(key, MODEL_ARGS.get(key)))


def model_config(args, **changes):
    """The ModelConfig of the model flags in `args` (the heads' where given), for rows of seq_len + 1 ids."""
    from minilm.config import ModelConfig

    heads = {k: getattr(args, k) for k in ("num_attention_heads", "num_key_value_heads") if hasattr(args, k)}
    return ModelConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers, **heads,
                       vocab_size=args.vocab_size, max_position_embeddings=args.seq_len + 1, **changes)


def build(cfg, train_cfg, device: torch.device | str = "cpu"):
    """(model, optimizer): seed 0 (the same weights for a size's every configuration), prepared as the loop does."""
    from minilm.model import MiniMindForCausalLM
    from minilm.step import make_optimizer, prepare_model

    torch.manual_seed(0)
    model = prepare_model(MiniMindForCausalLM(cfg).to(device).train(), train_cfg, torch.device(device))
    return model, make_optimizer(model, train_cfg)


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


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def environment() -> dict:
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    env = {"cpu": cpu, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "torch": torch.__version__, "python": platform.python_version(), "load_average": load_average(),
           "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def machine(env: dict, gpu: bool = False) -> str:
    """The header line of a benchmark's output."""
    where = env.get("gpu", "no GPU") if gpu else f"{env['cpu']}, {env['cpus']} CPUs, {env['torch_threads']} threads"
    return f"# {where}, torch {env['torch']}, load average {env['load_average']}"


def table(head: list[str], rows: list[list], left: int = 1) -> str:
    """Columns as wide as their widest cell; the first `left` aligned left, the others right."""
    cells = [[str(c) for c in row] for row in [head, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in
                               enumerate(zip(row, widths, strict=True))).rstrip() for row in cells)


def memory(pid: int | None = None) -> dict:
    """RSS, its peak (hwm), anon (private), shmem (Ray's object store) and file, in bytes, from /proc/PID/status."""
    out = {}
    with open(f"/proc/{pid or os.getpid()}/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key.removeprefix("Vm").removeprefix("Rss").lower()] = int(line.split()[1]) * 1024
    return out


def child_env(**extra: str) -> dict:
    """This environment for a child that starts its own local Ray (no RAY_ADDRESS), with `extra` set."""
    return {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **extra}


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def steady_step_s(records: list[dict], checkpoint_every: int) -> tuple[float, int]:
    """(wall seconds per step, steps counted) between metrics records, without the intervals that hold a checkpoint."""
    pairs = [(a, b) for a, b in zip(records[:-1], records[1:], strict=True) if a["optimizer_step"] % checkpoint_every]
    steps = sum(b["optimizer_step"] - a["optimizer_step"] for a, b in pairs)
    if steps == 0:
        raise SystemExit("no steady log interval: raise --steps to several --log-every")
    return sum(b["time"] - a["time"] for a, b in pairs) / steps, steps
