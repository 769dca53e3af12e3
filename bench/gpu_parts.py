"""The GPU check's parts that are subcommands, each in its own process: `python -m bench.gpu_check NAME ...`
(row, ddp1, trainer-ddp1, stream-rate, ray-keeper; the preflight is bench/gpu_preflight.py)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .common import add_model_args, alternate


def write_result(path: str, result: dict) -> None:
    """Whole or not at all: the check reads a part's file the moment it appears."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)


def stream_rate(argv: list[str]) -> int:
    """bench.data's `rank_stream_rate` on the prepared data, micro-batches to --device."""
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check stream-rate")
    add_model_args(p)
    p.add_argument("--data", required=True)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=400, help="optimizer steps timed after the first (pipeline start)")
    p.add_argument("--device", default="cpu", help="where the micro-batches go (cuda: pinned, async copies)")
    args = p.parse_args(argv)
    import numpy as np

    from minilm import data as D
    from ray_jobs.cli import ensure_ray

    from .data import rank_stream_rate

    ensure_ray()
    prepared = D.open_prepared(args.data)
    D.check_compatible(prepared, vocab_size=args.vocab_size, seq_len=args.seq_len)
    train_ids = np.arange(prepared.num_sequences, dtype=np.int64)
    per_epoch = D.steps_per_epoch(len(train_ids), args.global_batch_size)
    order = D.RankOrder(train_ids, 0, per_epoch, args.global_batch_size, 1, 0, 0)
    found = rank_stream_rate(args.data, order, args.steps, args.micro_batch_size, args.device)
    print(f"pipeline start {found['start_s']:.2f} s; {args.steps} steps of {args.global_batch_size} x {args.seq_len} "
          f"tokens in {found['seconds']:.2f} s ({per_epoch} steps per epoch)")
    print(f"stream delivery rate: {found['tokens_per_s']:,.0f} tokens/s")
    return 0


def ray_keeper(argv: list[str]) -> int:
    """Start the local Ray every Ray part joins (RAY_ADDRESS), describe it in --json, keep it up until SIGTERM; its
    own process, so the check holds ray.init to a part's limit. A fixed object store and no memory monitor: Ray
    would size both from the MemTotal of a VM whose memory grows as it is used."""
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check ray-keeper")
    p.add_argument("--json", required=True)
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
        node = ray.nodes()[0]
        # ray.init turns token auth on for the Ray it starts and says so in this process's environment only
        shared = {k: v for k, v in os.environ.items()
                  if k.startswith(("RAY_AUTH", "RAY_memory_monitor", "RAY_ENABLE_WINDOWS_OR_OSX"))}
        write_result(args.json, {"address": ray.get_runtime_context().gcs_address, "env": shared,
                                 "node_ip": node["NodeManagerAddress"], "num_cpus": node["Resources"].get("CPU"),
                                 "object_store_bytes": int(node["Resources"].get("object_store_memory", 0)),
                                 "memory_monitor_refresh_ms": os.environ["RAY_memory_monitor_refresh_ms"]})
        print(f"ray-keeper: a local Ray at {ray.get_runtime_context().gcs_address}", flush=True)
        while True:
            time.sleep(3600)
    finally:
        ray.shutdown()


class DynamoCounts:
    """Graph breaks, compiled graphs and recompiles of this process's torch.compile."""

    def __init__(self):
        import logging

        import torch._dynamo.guards  # noqa: F401  (creates the recompiles logger)
        import torch._logging

        self.recompiles = 0
        torch._logging.set_logs(recompiles=True)
        counts = self

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
    """Which kernel SDPA runs for this row: one forward + backward of a 1-layer model of its config and shape under
    the profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from minilm.model import MiniMindForCausalLM

    model = MiniMindForCausalLM(type(cfg)(**{**cfg.to_dict(), "num_hidden_layers": 1})).to(device).train()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            model(ids[:, :-1], targets=ids[:, 1:]).loss.backward()
    ran = {SDPA_OPS[k] for k in (e.key.removeprefix("aten::") for e in prof.key_averages()) if k in SDPA_OPS}
    return {"kernel": " + ".join(sorted(ran)) or "none found", "batch": batch, "seq": seq, "dtype": str(dtype),
            "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "document_mask": cfg.document_mask}


def row_args(argv: list[str]):
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check row")
    add_model_args(p)
    p.add_argument("--name", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--moe", action="store_true", help="4 experts, top-1 (the dense model's active width)")
    p.add_argument("--moe-dispatch", choices=["auto", "grouped", "split"], default="auto",
                   help="minilm.model.MoEFeedForward.dispatch")
    p.add_argument("--document-mask", action="store_true", help="attention within each document (ModelConfig)")
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--profile", action="store_true", help="one more step under torch.profiler: its top kernels")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (with --compile: the compilation)")
    p.add_argument("--peak-size", type=int, default=None, help="n of the n^3 matmul peak (default 8192 GPU, 2048 CPU)")
    return p.parse_args(argv)


def row(argv: list[str]) -> int:
    """One row of the table: optimizer steps of one config, timed alone in this process; writes --json."""
    args = row_args(argv)
    import torch

    from minilm.config import TrainConfig
    from minilm.progress import datasheet_peak, measured_matmul_peak
    from minilm.step import TORCH_DTYPES, configure_backends

    from .step import build, figures, model_config, random_batches, stepper

    device, dtype = torch.device(args.device), TORCH_DTYPES[args.dtype]
    configure_backends(device)
    counts = DynamoCounts() if args.compile else None
    peak = measured_matmul_peak(dtype, n=args.peak_size or (8192 if device.type == "cuda" else 2048), repeats=10,
                                device=device)
    train_cfg = TrainConfig(lr=1e-4, compile=args.compile, activation_checkpointing=args.activation_checkpointing,
                            optimizer=args.optimizer)
    cfg = model_config(args, 4 if args.moe else 0, 1, args.document_mask)
    sdpa = sdpa_kernel(cfg, args.micro_batch_size, args.seq_len, dtype, device)
    model, optimizer = build(cfg, train_cfg, device)
    dispatch = None
    if args.moe:  # what "auto" resolves to here: grouped where grouped_mm has its sync-free kernel
        grouped = model.moe_layers()[0].grouped_kernel and dtype == torch.bfloat16
        dispatch = args.moe_dispatch if args.moe_dispatch != "auto" else ("grouped" if grouped else "split")
    batches = random_batches(args, args.warmup + args.steps, device)
    step = stepper(model, optimizer, batches, dtype, args.moe_dispatch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    timed = alternate({args.name: step}, args.steps, args.warmup, device)[args.name]  # bench.step's timing
    warm_s = time.perf_counter() - t0 - sum(timed)
    sheet = datasheet_peak(torch.cuda.get_device_name(device), dtype) if device.type == "cuda" else None
    if device.type == "cuda":
        peak_memory, peak_of = torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    else:
        import resource

        peak_memory, peak_of = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "the process's max RSS"
    result = {"name": args.name, "config": ("moe" if args.moe else "dense") + ("+compile" if args.compile else ""),
              "dtype": args.dtype, "compile": args.compile, **figures(model, timed, args, peak, sheet),
              "warmup_s": warm_s, "peak_memory_bytes": peak_memory, "peak_memory_of": peak_of,
              # the warm-up steps' time beyond as many steady steps: compilation and autotuning
              "compile_s": max(0.0, warm_s - args.warmup * statistics.median(timed)) if args.compile else None,
              "document_mask": args.document_mask, "optimizer": args.optimizer,
              "activation_checkpointing": args.activation_checkpointing, "profile": None, "moe_dispatch": dispatch,
              "sdpa": sdpa, **(counts.read() if counts else {"graph_breaks": None, "graphs": None, "recompiles": None})}
    write_result(args.json, result)  # before the profiler: its failure loses nothing
    if args.profile:
        try:
            result["profile"] = profiled_step(step, len(batches) - 1, device)
        except Exception as e:  # noqa: BLE001  (the profiler's failure is a note on a row already measured)
            result["profile"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        write_result(args.json, result)
    print(f"row {args.name}: {result['tokens_per_s']:,.0f} tok/s, MFU {result['mfu']:.1%} of the measured peak, "
          f"SDPA {sdpa['kernel']}")
    return 0


def profiled_step(step, i: int, device) -> dict:
    """Step i again under torch.profiler: its 10 costliest kernels (CUDA) or ops (CPU), and whether flash ran."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step(i)
    events = prof.key_averages()
    if device.type == "cuda":
        timed = [(e.key, getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)) for e in events]
        timed = [(k, t) for k, t in timed if t > 0 and not k.startswith(("aten::", "cuda", "Memcpy", "Memset"))]
    else:
        timed = [(e.key, e.self_cpu_time_total) for e in events]
    top = sorted(timed, key=lambda kt: -kt[1])[:10]
    return {"top": [{"name": k[:120], "us": round(t, 1)} for k, t in top], "of": device.type,
            "flash": any("flash" in e.key.lower() for e in events)}


def group_args(prog: str, steps: int, argv: list[str]):
    p = argparse.ArgumentParser(prog=f"python -m bench.gpu_check {prog}")
    add_model_args(p)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", required=True)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--steps", type=int, default=steps)
    return p.parse_args(argv)


def training_device(name: str):
    """The device a part trains on, made the current one; CUDA with an index (torch.cuda.set_device needs one)."""
    import torch

    device = torch.device(name)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    return device


def largest_relative_difference(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-6) for x, y in zip(a, b, strict=True))


def ddp1(argv: list[str]) -> int:
    """DDP in a 1-rank process group (NCCL on CUDA, gloo on CPU) against the same model without DDP, step by step;
    the losses must agree."""
    args = group_args("ddp1", 10, argv)
    import torch
    import torch.distributed as dist

    from minilm.config import TrainConfig
    from minilm.distributed import leave_process_group
    from minilm.step import configure_backends, make_grad_scaler, optimizer_step
    from minilm.trainer import wrap_ddp

    from .step import build, model_config

    device = training_device(args.device)
    configure_backends(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    train_cfg = TrainConfig(optimizer="adamw", lr=1e-4, compile=args.compile)
    losses: dict[str, list[float]] = {"plain": [], "ddp": []}
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            runs = {}
            for name in ("plain", "ddp"):
                model, optimizer = build(model_config(args), train_cfg, device)
                runs[name] = (wrap_ddp(model, device) if name == "ddp" else model, optimizer,
                              make_grad_scaler(torch.bfloat16, device.type))
            gen = torch.Generator().manual_seed(1)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                micro = [torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_len + 1), generator=gen)
                         .to(device) for _ in range(2)]  # accumulation 2: no_sync, then the reducer's all-reduce
                for name, (model, optimizer, scaler) in runs.items():
                    m = optimizer_step(model, optimizer, scaler, micro, lr=1e-4, grad_clip=1.0, dtype=torch.bfloat16)
                    loss = m.loss.detach().reshape(1).clone()
                    if name == "ddp":
                        dist.all_reduce(loss)  # the loop's metric all-reduce, on the training device
                    losses[name].append(float(loss))
            wall_s = time.perf_counter() - t0
        finally:
            runs, model = {}, None  # DDP goes while its group lives (gloo's destructor can hang after)
            leave_process_group()
    worst = largest_relative_difference(losses["ddp"], losses["plain"])
    write_result(args.json, {"backend": backend, "compile": args.compile, "steps": args.steps, "losses": losses,
                             "max_relative_difference": worst, "wall_s": wall_s})
    print(f"ddp1: {backend}, {args.steps} steps of accumulation 2{' compiled' if args.compile else ''}: loss "
          f"{losses['ddp'][0]:.4f} -> {losses['ddp'][-1]:.4f}, largest relative difference from the plain model "
          f"{worst:.2e}")
    if worst > 1e-3:
        print(f"error: ddp1: DDP's losses differ from the plain model's by up to {worst:.2e} (relative)")
        return 1
    return 0


def group_trainer_class():
    """The Trainer set up as a rank of a multi-rank run (DDP, collectives through the group even at world size 1),
    and its count of those collectives."""
    import torch.distributed as dist

    from minilm.distributed import Collectives
    from minilm.trainer import Trainer, wrap_ddp

    class GroupCollectives(Collectives):
        calls = 0

        def all_reduce(self, tensor, op=None, async_op=False):
            GroupCollectives.calls += 1
            tensor = self.to_device(tensor)
            return tensor, dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, async_op=async_op)

        def broadcast_from_rank0(self, tensor):
            GroupCollectives.calls += 1
            tensor = self.to_device(tensor.clone())
            dist.broadcast(tensor, src=0)
            return tensor

    class GroupTrainer(Trainer):
        def start(self) -> None:
            self.collectives = GroupCollectives(self.device)
            super().start()
            self.model = wrap_ddp(self.raw_model, self.device)

    return GroupTrainer, GroupCollectives


def fit_trainer(name: str, trainer_class, args, device, backend: str) -> dict:
    """One Trainer run, accumulation 2, in a 1-rank process group for "ddp"; tokens/s: the median log interval's
    after the first."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from minilm.config import TrainConfig
    from minilm.distributed import leave_process_group
    from minilm.train import LocalLauncher
    from minilm.trainer import Dataset, RunOptions

    from .step import model_config

    train_cfg = TrainConfig(optimizer="adamw", lr=1e-4, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                            global_batch_size=2 * args.micro_batch_size, max_steps=args.steps, warmup_steps=1,
                            log_every=max(1, args.steps // 5), checkpoint_every=args.steps, compile=args.compile,
                            dtype="bf16")
    data = Dataset.in_memory(np.random.default_rng(1).integers(0, args.vocab_size,
                                                               (4 * args.micro_batch_size, args.seq_len + 1)))
    with tempfile.TemporaryDirectory() as tmp:
        if name == "ddp":
            dist.init_process_group(backend, init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            launcher = LocalLauncher(data, args.micro_batch_size, device=device,
                                     say=lambda line: print(f"{name}: {line}", flush=True))
            trainer = trainer_class(model_config(args), train_cfg, RunOptions(name=f"trainer-ddp1-{name}"), data,
                                    launcher)
            t0 = time.perf_counter()
            outcome = trainer.fit()
            wall_s = time.perf_counter() - t0
            ddp = isinstance(trainer.model, torch.nn.parallel.DistributedDataParallel)
        finally:
            if name == "ddp":
                trainer.model = trainer.raw_model  # DDP goes while its group lives
                leave_process_group()
    rates = [m["tokens_per_s"] for m in trainer.history]
    return {"outcome": outcome, "ddp": ddp, "wall_s": wall_s, "losses": [m["loss"] for m in trainer.history],
            "tokens_per_s_intervals": rates, "tokens_per_s": statistics.median(rates[1:] if len(rates) > 1 else rates)}


def trainer_ddp1(argv: list[str]) -> int:
    """minilm's Trainer as a plain world-size-1 run, then DDP-wrapped in a 1-rank process group, its collectives
    through the group; both runs' tokens/s and losses (which must agree) to --json."""
    args = group_args("trainer-ddp1", 40, argv)
    from minilm.trainer import Trainer

    device = training_device(args.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    group_trainer, collectives = group_trainer_class()
    runs = {name: fit_trainer(name, cls, args, device, backend)
            for name, cls in (("plain", Trainer), ("ddp", group_trainer))}
    worst = largest_relative_difference(runs["ddp"]["losses"], runs["plain"]["losses"])
    ratio = runs["ddp"]["tokens_per_s"] / runs["plain"]["tokens_per_s"]
    write_result(args.json, {"backend": backend, "compile": args.compile, "steps": args.steps, "accumulation": 2,
                             "runs": runs, "ddp_over_plain": ratio, "max_relative_difference": worst,
                             "group_collectives": collectives.calls})
    print(f"trainer-ddp1: {backend}{', compiled' if args.compile else ''}, {args.steps} steps: DDP in the group "
          f"{runs['ddp']['tokens_per_s']:,.0f} tok/s = {ratio:.3f}x the plain Trainer's "
          f"{runs['plain']['tokens_per_s']:,.0f}; losses within {worst:.2e}; {collectives.calls} of the loop's "
          f"collectives through the group")
    if not runs["ddp"]["ddp"] or worst > 1e-3:
        print(f"error: trainer-ddp1: DDP's losses differ from the plain Trainer's by up to {worst:.2e} (relative)"
              if runs["ddp"]["ddp"] else "error: trainer-ddp1: the Trainer in the group ran without DDP")
        return 1
    return 0


COMMANDS = {"ray-keeper": ray_keeper, "stream-rate": stream_rate, "row": row, "ddp1": ddp1, "trainer-ddp1": trainer_ddp1}
