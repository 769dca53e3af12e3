"""The GPU check's first part, `python -m bench.gpu_check preflight --json PATH`: versions, the cold start's phases,
and the gates (Ray import, compile) whose closing skips the parts behind them."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import subprocess
import sys
import time

from .gpu_parts import write_result


def tf32_state() -> dict:
    """TF32 as both the legacy getters and the torch >= 2.9 ones report it; a getter that raises is a failure (a
    mix of the two setter APIs makes torch refuse the legacy reads, which Inductor's autotuning makes)."""
    import torch

    getters = {
        "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision,
        "torch.backends.cuda.matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
        "torch.backends.cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
    }
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        getters["torch.backends.cuda.matmul.fp32_precision"] = lambda: torch.backends.cuda.matmul.fp32_precision
        getters["torch.backends.cudnn.conv.fp32_precision"] = lambda: torch.backends.cudnn.conv.fp32_precision
    state = {}
    for name, get in getters.items():
        try:
            state[name] = get()
        except Exception as e:  # noqa: BLE001  (what torch raises here is a RuntimeError today)
            state[name] = f"raises {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return state


def process_age() -> float | None:
    """Seconds since this process started (python, then the imports of torch and minilm), from /proc."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.splitlines()[0] if out else None


def tiny_compiled_step(device) -> float:
    """A 2-layer MiniMind block stack compiled the way the training loop compiles it, one forward+backward."""
    import torch

    from minilm.config import ModelConfig, TrainConfig
    from minilm.model import MiniMindForCausalLM
    from minilm.step import prepare_model

    t0 = time.perf_counter()
    cfg = ModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=256, max_position_embeddings=65)
    model = prepare_model(MiniMindForCausalLM(cfg).to(device).train(), TrainConfig(compile=True), device)
    ids = torch.randint(0, 256, (2, 65), device=device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
        out = model(ids[:, :-1], targets=ids[:, 1:])
    out.loss.backward()
    if not torch.isfinite(out.loss):
        raise RuntimeError(f"non-finite loss {float(out.loss)}")
    return time.perf_counter() - t0


def gate(gates: dict, name: str, found: dict, phase: str, fn, why: str):
    """Run fn as a timed phase; an exception closes the gate `name` with `why` and the error."""
    t0 = time.perf_counter()
    try:
        return fn()
    except Exception as e:  # noqa: BLE001  (a broken install or kernel shows up as any error)
        gates[name] = f"{why}: {type(e).__name__}: {str(e)[:200]}"
    finally:
        found["phases_s"][phase] = time.perf_counter() - t0


def preflight(argv: list[str]) -> int:
    """The check's first part and its cold start, measured: versions, the start's phases, and the gates. A closed
    gate is a result ("gates": what it closes and why), not a failure: the check skips what is behind it."""
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check preflight")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    started_s = process_age()
    import torch

    from minilm.step import configure_backends

    device, cuda = torch.device(args.device), args.device.startswith("cuda")
    found: dict = {"torch": torch.__version__, "python": sys.version.split()[0], "cuda": torch.version.cuda,
                   "phases_s": {"process_start": started_s}}
    # SDPA's kernel is each row's own result, found at its shape (gpu_parts.sdpa_kernel)
    gates: dict[str, str | None] = {"ray": None, "compile": None}
    if cuda:
        t0 = time.perf_counter()
        torch.ones(1, device=device).add_(1).item()
        found["phases_s"]["cuda_context"] = time.perf_counter() - t0
        found.update(gpu=torch.cuda.get_device_name(device), driver=nvidia_driver(),
                     capability=".".join(map(str, torch.cuda.get_device_capability(device))))
    for name in ("triton", "ray", "numpy", "pyarrow", "tokenizers"):
        found[name] = __import__(name).__version__ if importlib.util.find_spec(name) else None
    if found["ray"] is None:
        gates["ray"] = "no ray in this python (bash bench/gpu_bundle.sh, then bench/gpu_check.sh --bundle DIR)"
    else:
        gate(gates, "ray", found, "import_ray", lambda: [importlib.import_module(m) for m in ("ray.data",
             "ray.train.torch")], "import ray.train.torch, ray.data")
    configure_backends(device)
    found["tf32"] = tf32_state()
    raising = [f"{k} {v}" for k, v in found["tf32"].items() if str(v).startswith("raises")]
    if raising:  # Inductor's autotuning reads these getters
        gates["compile"] = "; ".join(raising)
    elif cuda:  # Triton's first compilation; on CPU (C++) the compiled rows are the first anyway
        compile_s = gate(gates, "compile", found, "compile", lambda: tiny_compiled_step(device),
                         f"compiled forward+backward on {device.type}")
        found.update({"compile_s": compile_s} if compile_s is not None else {})
    found["gates"] = gates
    parts = [f"torch {found['torch']}", f"python {found['python']}"]
    parts += [f"{k} {found[k]}" for k in ("gpu", "capability", "cuda", "driver", "triton", "ray", "numpy", "pyarrow")
              if found.get(k)]
    found["line"] = ", ".join(parts + ([f"compile {found['compile_s']:.1f} s"] if "compile_s" in found else []))
    write_result(args.json, found)
    print(f"preflight: {found['line']}")
    print("  cold start: " + ", ".join(f"{k} {v:.1f} s" for k, v in found["phases_s"].items() if v is not None))
    for name, value in [*found["tf32"].items(), *((f"gate {k} closed", v) for k, v in gates.items() if v)]:
        print(f"  {name}: {value}")
    return 0
