"""The GPU check's parts that are subcommands, each in its own process: `python -m bench.gpu_check NAME ...`
(preflight, row, trainer-ddp1, ray-keeper); each writes its figures to --json."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import signal
import statistics
import sys
import tempfile
import time

from .common import add_model_args, alternate, build, write_atomic


def parser(prog: str, model: bool = True, device: str = "cuda") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m bench.gpu_check {prog}")
    p.add_argument("--json", required=True)
    p.add_argument("--device", default=device)
    if model:
        add_model_args(p)
    return p


def write_result(path: str, result: dict) -> None:
    write_atomic(path, json.dumps(result, indent=2) + "\n")


# ---- preflight: versions, the cold start's phases, and the gates whose closing skips the parts behind them --------

def tiny_compiled_step(device) -> None:
    """A 2-layer MiniMind block stack compiled the way the training loop compiles it, one forward+backward."""
    import torch

    from minilm.config import ModelConfig, TrainConfig

    cfg = ModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=256, max_position_embeddings=65)
    model, _ = build(cfg, TrainConfig(compile=True, optimizer="adamw"), device)
    ids = torch.randint(0, 256, (2, 65), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = model(ids[:, :-1], targets=ids[:, 1:])
    out.loss.backward()
    if not torch.isfinite(out.loss):
        raise RuntimeError(f"non-finite loss {float(out.loss)}")


def preflight(argv: list[str]) -> int:
    """The check's first part and its cold start, measured: versions, the start's phases, and the gates. A closed
    gate is a result ("gates": what it closes and why), not a failure: the check skips what is behind it."""
    args = parser("preflight", model=False).parse_args(argv)
    with open("/proc/self/stat") as f, open("/proc/uptime") as up:  # python, then the imports of torch and minilm
        started_s = float(up.read().split()[0]) - int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf(
            "SC_CLK_TCK")
    import torch

    from minilm.step import configure_backends

    device, cuda = torch.device(args.device), args.device.startswith("cuda")
    found: dict = {"torch": torch.__version__, "python": sys.version.split()[0], "cuda": torch.version.cuda,
                   "phases_s": {"process_start": started_s}}
    gates: dict[str, str | None] = {"ray": None, "compile": None}  # SDPA's kernel: each row's own (sdpa_kernel)

    def phase(name: str, gate: str, why: str, fn) -> None:  # fn timed; its failure closes the gate
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001  (a broken install or kernel shows up as any error)
            gates[gate] = f"{why}: {type(e).__name__}: {str(e)[:200]}"
        found["phases_s"][name] = time.perf_counter() - t0

    if cuda:
        t0 = time.perf_counter()
        torch.ones(1, device=device).add_(1).item()
        found["phases_s"]["cuda_context"] = time.perf_counter() - t0
        found.update(gpu=torch.cuda.get_device_name(device),
                     capability=".".join(map(str, torch.cuda.get_device_capability(device))))
    for name in ("triton", "ray", "numpy", "pyarrow", "tokenizers"):
        found[name] = __import__(name).__version__ if importlib.util.find_spec(name) else None
    if found["ray"] is None:
        gates["ray"] = "no ray in this python (bash bench/gpu_bundle.sh, then bench/gpu_check.sh --bundle DIR)"
    else:
        phase("import_ray", "ray", "import ray.train.torch, ray.data",
              lambda: [importlib.import_module(m) for m in ("ray.data", "ray.train.torch")])
    configure_backends(device)
    if cuda:  # Triton's first compilation (and Inductor's reads of the TF32 getters); on CPU the rows compile first
        phase("compile", "compile", f"compiled forward+backward on {device.type}", lambda: tiny_compiled_step(device))
        found.update({"compile_s": found["phases_s"]["compile"]} if not gates["compile"] else {})
    found["gates"] = gates
    found["line"] = ", ".join([f"torch {found['torch']}", f"python {found['python']}"] + [
        f"{k} {found[k]}" for k in ("gpu", "capability", "cuda", "triton", "ray", "numpy", "pyarrow")
        if found.get(k)] + ([f"compile {found['compile_s']:.1f} s"] if "compile_s" in found else []))
    write_result(args.json, found)
    print(f"preflight: {found['line']}\n  cold start: " + ", ".join(
        f"{k} {v:.1f} s" for k, v in found["phases_s"].items()))
    for name, value in gates.items():
        print(f"  gate {name}: {value or 'open'}")
    return 0


# ---- a row: one configuration's optimizer steps, timed alone --------------------------------------------------

class DynamoCounts:
    """Graph breaks, compiled graphs and recompiles of this process's torch.compile."""

    def __init__(self):
        import logging

        import torch._dynamo.guards  # noqa: F401  (creates the recompiles logger)
        import torch._logging

        self.recompiles, counts = 0, self
        torch._logging.set_logs(recompiles=True)

        class Count(logging.Handler):
            def emit(self, record):
                counts.recompiles += record.getMessage().startswith("Recompiling")

        logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(Count())

    def read(self) -> dict:
        from torch._dynamo.utils import counters

        return {"graph_breaks": sum(counters["graph_break"].values()),
                "graphs": counters["stats"].get("unique_graphs", 0), "recompiles": self.recompiles}


SDPA_OPS = {"_scaled_dot_product_flash_attention": "flash", "_scaled_dot_product_cudnn_attention": "cudnn",
            "_scaled_dot_product_efficient_attention": "efficient", "_scaled_dot_product_attention_math": "math",
            "_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
            "_scaled_dot_product_fused_attention_overrideable": "overrideable"}


def sdpa_kernel(cfg, batch: int, seq: int, dtype, device) -> dict:
    """Which kernel SDPA runs for this row: a 1-layer model of its config and shape, profiled forward + backward."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from minilm.model import MiniMindForCausalLM, resolve_gqa

    gqa = resolve_gqa(cfg, batch, seq, dtype, device)  # "auto" timed on CUDA first: the kernel profiled is the run's
    model = MiniMindForCausalLM(type(cfg)(**{**cfg.to_dict(), "num_hidden_layers": 1})).to(device).train()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            model(ids[:, :-1], targets=ids[:, 1:]).loss.backward()
    ran = {SDPA_OPS[k] for k in (e.key.removeprefix("aten::") for e in prof.key_averages()) if k in SDPA_OPS}
    return {"kernel": " + ".join(sorted(ran)) or "none found", "batch": batch, "seq": seq, "dtype": str(dtype),
            "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "document_mask": cfg.document_mask, "gqa": gqa}


def profiled_step(step, i: int, device) -> dict:
    """Step i again under torch.profiler: its 10 costliest kernels (CUDA) or ops (CPU), and whether flash ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device.type == "cuda" else [])]) as p:
        step(i)
    events = p.key_averages()
    if device.type == "cuda":
        timed = [(e.key, getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)) for e in events]
        timed = [(k, t) for k, t in timed if t > 0 and not k.startswith(("aten::", "cuda", "Memcpy", "Memset"))]
    else:
        timed = [(e.key, e.self_cpu_time_total) for e in events]
    return {"top": [{"name": k[:120], "us": round(t, 1)} for k, t in sorted(timed, key=lambda kt: -kt[1])[:10]],
            "of": device.type, "flash": any("flash" in e.key.lower() for e in events)}


def row_args(argv: list[str]):
    p = parser("row")
    p.add_argument("--name", required=True)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    for flag in ("--moe", "--document-mask", "--activation-checkpointing", "--profile"):
        p.add_argument(flag, action="store_true")  # --moe: 4 experts, top-1; --profile: one more step, profiled
    p.add_argument("--compile", nargs="?", choices=["off", "blocks", "model"], const="blocks", default="off")
    p.add_argument("--moe-dispatch", choices=["auto", "grouped", "split"], default="auto")
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (with --compile: the compilation)")
    p.add_argument("--peak-size", type=int, default=None, help="n of the n^3 matmul peak (default 8192 GPU, 2048 CPU)")
    return p.parse_args(argv)


def row(argv: list[str]) -> int:
    """One row of the table: optimizer steps of one config, timed alone in this process with bench.step's `build`,
    `stepper` and `figures`; writes --json (before the profiled step: its failure loses nothing)."""
    args = row_args(argv)
    import resource

    import torch

    from minilm.config import TrainConfig
    from minilm.progress import datasheet_peak, measured_matmul_peak
    from minilm.step import TORCH_DTYPES, configure_backends

    from .step import SUFFIX, figures, model_config, random_batches, stepper

    device, dtype, cuda = torch.device(args.device), TORCH_DTYPES[args.dtype], args.device.startswith("cuda")
    configure_backends(device)
    compiled = args.compile != "off"
    counts = DynamoCounts() if compiled else None
    peak = measured_matmul_peak(dtype, n=args.peak_size or (8192 if cuda else 2048), repeats=10, device=device)
    cfg = model_config(args, 4 if args.moe else 0, 1, args.document_mask)
    sdpa = sdpa_kernel(cfg, args.micro_batch_size, args.seq_len, dtype, device)
    model, optimizer = build(cfg, TrainConfig(lr=1e-4, compile=args.compile, optimizer=args.optimizer,
                                              activation_checkpointing=args.activation_checkpointing), device)
    dispatch = None
    if args.moe:  # what "auto" resolves to here: grouped where grouped_mm has its sync-free kernel
        grouped = model.moe_layers()[0].grouped_kernel and dtype == torch.bfloat16
        dispatch = args.moe_dispatch if args.moe_dispatch != "auto" else ("grouped" if grouped else "split")
    batches = random_batches(args, args.warmup + args.steps, device)
    step = stepper(model, optimizer, batches, dtype, args.moe_dispatch)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    timed = alternate({args.name: step}, args.steps, args.warmup, device)[args.name]
    warm_s = time.perf_counter() - t0 - sum(timed)
    sheet = datasheet_peak(torch.cuda.get_device_name(device), dtype) if cuda else None
    memory = ((torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated") if cuda else
              (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "the process's max RSS"))
    result = {"name": args.name, "config": ("moe" if args.moe else "dense") + SUFFIX[args.compile],
              "dtype": args.dtype, "compile": args.compile, **figures(model, timed, args, peak, sheet),
              "warmup_s": warm_s, "peak_memory_bytes": memory[0], "peak_memory_of": memory[1],
              # the warm-up steps' time beyond as many steady steps: compilation and autotuning
              "compile_s": max(0.0, warm_s - args.warmup * statistics.median(timed)) if compiled else None,
              "document_mask": args.document_mask, "optimizer": args.optimizer,
              "activation_checkpointing": args.activation_checkpointing, "profile": None, "moe_dispatch": dispatch,
              "sdpa": sdpa, **(counts.read() if counts else dict.fromkeys(("graph_breaks", "graphs", "recompiles")))}
    write_result(args.json, result)
    if args.profile:
        try:
            result["profile"] = profiled_step(step, len(batches) - 1, device)
        except Exception as e:  # noqa: BLE001  (the profiler's failure is a note on a row already measured)
            result["profile"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        write_result(args.json, result)
    print(f"row {args.name}: {result['tokens_per_s']:,.0f} tok/s, MFU {result['mfu']:.1%} of the measured peak, "
          f"SDPA {sdpa['kernel']}")
    return 0


# ---- trainer-ddp1: minilm's Trainer plain, then DDP-wrapped in a 1-rank process group --------------------------

def fit_trainer(name: str, args, device, backend: str) -> tuple[dict, int]:
    """One Trainer run, accumulation 2: plain, or ("ddp") as a rank of a multi-rank run in a 1-rank process group
    (DDP, its collectives through the group even at world size 1); its figures and the collectives counted.
    Tokens/s: the median log interval's after the first."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from minilm.config import TrainConfig
    from minilm.distributed import Collectives, leave_process_group
    from minilm.train import LocalLauncher
    from minilm.trainer import Dataset, RunOptions, Trainer, wrap_ddp

    from .step import model_config

    class GroupCollectives(Collectives):
        calls = 0

        def all_reduce(self, tensor, op=None, async_op=False):
            GroupCollectives.calls += 1
            tensor = tensor.to(self.device)
            return tensor, dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, async_op=async_op)

        def broadcast_from_rank0(self, tensor):
            GroupCollectives.calls += 1
            tensor = tensor.clone().to(self.device)
            dist.broadcast(tensor, src=0)
            return tensor

    class GroupTrainer(Trainer):
        def start(self) -> None:
            self.collectives = GroupCollectives(self.device)
            super().start()
            self.model = wrap_ddp(self.raw_model, self.device)

    train_cfg = TrainConfig(optimizer="adamw", lr=1e-4, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                            global_batch_size=2 * args.micro_batch_size, max_steps=args.steps, warmup_steps=1, dtype="bf16",
                            log_every=max(1, args.steps // 5), checkpoint_every=args.steps, compile=args.compile)
    rows = np.random.default_rng(1).integers(0, args.vocab_size, (4 * args.micro_batch_size, args.seq_len + 1))
    data = Dataset.in_memory(rows)
    with tempfile.TemporaryDirectory() as tmp:
        if name == "ddp":
            dist.init_process_group(backend, init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            launcher = LocalLauncher(data, args.micro_batch_size, device=device,
                                     say=lambda line: print(f"{name}: {line}", flush=True))
            trainer = (GroupTrainer if name == "ddp" else Trainer)(
                model_config(args), train_cfg, RunOptions(name=f"trainer-ddp1-{name}"), data, launcher)
            t0 = time.perf_counter()
            outcome = trainer.fit()
            wall_s = time.perf_counter() - t0
            ddp = isinstance(trainer.model, torch.nn.parallel.DistributedDataParallel)
        finally:
            if name == "ddp":
                trainer.model = trainer.raw_model  # DDP goes while its group lives
                leave_process_group()
    rates = [m["tokens_per_s"] for m in trainer.history]
    figures = {"outcome": outcome, "ddp": ddp, "wall_s": wall_s, "losses": [m["loss"] for m in trainer.history],
               "tokens_per_s_intervals": rates, "tokens_per_s": statistics.median(rates[1:] or rates)}
    return figures, GroupCollectives.calls


def trainer_ddp1(argv: list[str]) -> int:
    """minilm's Trainer plain, then DDP-wrapped in a 1-rank group (NCCL; gloo on CPU): tokens/s, losses (must agree)."""
    p = parser("trainer-ddp1")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    import torch

    device = torch.device(args.device)
    if device.type == "cuda":  # made the current one, with an index (torch.cuda.set_device needs one)
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    (plain, _), (ddp, calls) = (fit_trainer(name, args, device, backend) for name in ("plain", "ddp"))
    worst = max(abs(x - y) / max(abs(y), 1e-6) for x, y in zip(ddp["losses"], plain["losses"], strict=True))
    ratio = ddp["tokens_per_s"] / plain["tokens_per_s"]
    write_result(args.json, {"backend": backend, "compile": args.compile, "steps": args.steps, "accumulation": 2,
                             "runs": {"plain": plain, "ddp": ddp}, "ddp_over_plain": ratio,
                             "max_relative_difference": worst, "group_collectives": calls})
    print(f"trainer-ddp1: {backend}{', compiled' if args.compile else ''}, {args.steps} steps: DDP in the group "
          f"{ddp['tokens_per_s']:,.0f} tok/s = {ratio:.3f}x the plain Trainer's {plain['tokens_per_s']:,.0f}; "
          f"losses within {worst:.2e}; {calls} of the loop's collectives through the group")
    if not ddp["ddp"] or worst > 1e-3:
        print(f"error: trainer-ddp1: DDP's losses differ from the plain Trainer's by up to {worst:.2e} (relative)"
              if ddp["ddp"] else "error: trainer-ddp1: the Trainer in the group ran without DDP")
        return 1
    return 0


# ---- ray-keeper: the local Ray of the Ray parts -------------------------------------------------------------------

def ray_keeper(argv: list[str]) -> int:
    """Start the local Ray every Ray part joins (RAY_ADDRESS), describe it in --json, keep it up until SIGTERM; its
    own process, so the check holds ray.init to a part's limit. A fixed object store and no memory monitor: Ray
    would size both from the MemTotal of a VM whose memory grows as it is used."""
    p = parser("ray-keeper", model=False)
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--object-store-bytes", type=int, required=True)
    args = p.parse_args(argv)
    # Read by the raylet and every driver after it. 127.0.0.1: the lent machine has no network, and Ray otherwise
    # finds a node's address by routing towards one.
    os.environ.update(RAY_memory_monitor_refresh_ms="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    import ray

    cores = os.cpu_count() or 2
    ray.init(address="local", num_cpus=cores if args.gpu else max(8, 2 * cores), num_gpus=1 if args.gpu else 0,
             object_store_memory=args.object_store_bytes, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False, logging_level="ERROR")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        node, address = ray.nodes()[0], ray.get_runtime_context().gcs_address
        # ray.init turns token auth on for the Ray it starts and says so in this process's environment only
        shared = {k: v for k, v in os.environ.items()
                  if k.startswith(("RAY_AUTH", "RAY_memory_monitor", "RAY_ENABLE_WINDOWS_OR_OSX"))}
        write_result(args.json, {"address": address, "env": shared, "node_ip": node["NodeManagerAddress"],
                                 "num_cpus": node["Resources"].get("CPU"),
                                 "object_store_bytes": int(node["Resources"].get("object_store_memory", 0)),
                                 "memory_monitor_refresh_ms": os.environ["RAY_memory_monitor_refresh_ms"]})
        print(f"ray-keeper: a local Ray at {address}", flush=True)
        while True:
            time.sleep(3600)
    finally:
        ray.shutdown()


COMMANDS = {"preflight": preflight, "row": row, "trainer-ddp1": trainer_ddp1, "ray-keeper": ray_keeper}
