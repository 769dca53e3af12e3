"""Throughput and MFU of one optimizer step on CPU, dense vs MoE with the same active parameters.

    python -m bench.step                                   # hidden 512, 4 layers, seq 256, micro-batch 8, fp32
    python -m bench.step --steps 4 --warmup 1              # quicker
    python -m bench.step --dtype both                      # add a bf16-autocast column

For each dtype it measures, in this process: the matmul peak (2048^3, best of 10, before and after
the steps; the larger counts) and `minilm.step.optimizer_step` (accumulation 1) for the dense model
and for the MoE model (4 experts, top-1: the same active FFN width). Dense and MoE steps alternate,
so background load hits both alike; warm-up steps are excluded. MFU = flops_per_token(seq_len) * tokens/s / measured peak.
Writes bench/results/step.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from minilm.config import ModelConfig, TrainConfig
from minilm.model import MiniMindForCausalLM
from minilm.step import make_grad_scaler, make_optimizer, optimizer_step

from .common import environment, matmul_peak_flops, write_json

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(args, use_moe: bool) -> MiniMindForCausalLM:
    # A micro-batch row is seq_len + 1 ids (input and shifted labels), all of them through the model.
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                      num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
                      vocab_size=args.vocab_size, max_position_embeddings=args.seq_len + 1, use_moe=use_moe,
                      num_experts=4, num_experts_per_tok=1)
    return MiniMindForCausalLM(cfg).train()


def bench_dtype(args, dtype_name: str) -> dict:
    dtype = DTYPES[dtype_name]
    peak_before = matmul_peak_flops(dtype)
    runs = {}
    for name, use_moe in (("dense", False), ("moe", True)):
        model = build(args, use_moe)
        gen = torch.Generator().manual_seed(1)
        runs[name] = {
            "model": model,
            "optimizer": make_optimizer(model, TrainConfig(lr=1e-4)),
            "scaler": make_grad_scaler(dtype, "cpu"),
            "batches": [torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_len + 1), generator=gen)
                        for _ in range(args.warmup + args.steps)],
            "times": [],
        }
    for i in range(args.warmup + args.steps):
        for r in runs.values():  # alternate dense / MoE step by step
            t0 = time.perf_counter()
            m = optimizer_step(r["model"], r["optimizer"], r["scaler"], [r["batches"][i]], lr=1e-4, grad_clip=1.0,
                               dtype=dtype)
            float(m.loss)
            if i >= args.warmup:
                r["times"].append(time.perf_counter() - t0)
    # Measured before and after the steps; the larger is the less disturbed by other load on the host.
    peak_after = matmul_peak_flops(dtype)
    peak = max(peak_before, peak_after)
    rows = []
    for name, r in runs.items():
        model = r["model"]
        step_s = statistics.median(r["times"])
        tokens = args.micro_batch_size * args.seq_len
        tps = tokens / step_s
        load = model.expert_load()
        rows.append({
            "config": name, "dtype": dtype_name,
            "params": model.num_params(), "active_params": model.num_params(active=True),
            "flops_per_token": model.flops_per_token(args.seq_len),
            "step_s_median": step_s, "step_s_min": min(r["times"]), "step_s_max": max(r["times"]),
            "tokens_per_step": tokens, "tokens_per_s": tps,
            "achieved_flops": model.flops_per_token(args.seq_len) * tps,
            "mfu": model.estimate_mfu(tps, args.seq_len, peak),
            "mfu_best_step": model.estimate_mfu(tokens / min(r["times"]), args.seq_len, peak),
            "max_expert_share": float(load.max()) if load is not None else None,
        })
    return {"dtype": dtype_name, "peak_flops": peak, "peak_flops_before": peak_before, "peak_flops_after": peak_after,
            "rows": rows,
            "moe_over_dense": rows[1]["step_s_median"] / rows[0]["step_s_median"],
            "moe_over_dense_min": rows[1]["step_s_min"] / rows[0]["step_s_min"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__.split("\n")[0])
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-hidden-layers", type=int, default=4)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--num-key-value-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=6400)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps per config")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps per config first")
    p.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="fp32")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)

    env = environment()
    print(f"# {env['cpu']}, {env['torch_threads']} torch threads, torch {env['torch']}")
    print(f"# hidden {args.hidden_size}, layers {args.num_hidden_layers}, vocab {args.vocab_size}, "
          f"seq {args.seq_len}, micro-batch {args.micro_batch_size}, accumulation 1, "
          f"{args.steps} timed steps after {args.warmup} warm-up")
    results = [bench_dtype(args, d) for d in (("fp32", "bf16") if args.dtype == "both" else (args.dtype,))]

    header = (f"{'config':<6} {'dtype':<5} {'params':>8} {'active':>8} {'step s':>7} {'min s':>7} {'tokens/s':>9} "
              f"{'GFLOP/s':>8} {'peak':>8} {'MFU':>6} {'best':>6}")
    print("step s = median optimizer step; tokens/s, GFLOP/s and MFU from the median; best = MFU of the fastest "
          "step; peak = matmul GFLOP/s")
    print(header)
    print("-" * len(header))
    for res in results:
        for r in res["rows"]:
            print(f"{r['config']:<6} {r['dtype']:<5} {r['params'] / 1e6:>7.1f}M {r['active_params'] / 1e6:>7.1f}M "
                  f"{r['step_s_median']:>7.3f} {r['step_s_min']:>7.3f} {r['tokens_per_s']:>9.0f} {r['achieved_flops'] / 1e9:>8.1f} "
                  f"{res['peak_flops'] / 1e9:>8.1f} {r['mfu']:>6.1%} {r['mfu_best_step']:>6.1%}")
    for res in results:
        print(f"matmul peak ({res['dtype']}, 2048^3, best of 10): {res['peak_flops_before'] / 1e9:.1f} GFLOP/s before, "
              f"{res['peak_flops_after'] / 1e9:.1f} after the steps; MFU uses the larger")
        if any(r["mfu"] > 1 for r in res["rows"]):
            print("  warning: MFU > 100%: the peak was measured while the host was busier than during the steps")
    for res in results:
        ratio = res["moe_over_dense"]
        print(f"MoE / dense step time ({res['dtype']}): {ratio:.2f}x median, {res['moe_over_dense_min']:.2f}x best "
              f"(target <= 1.10x){'' if ratio <= 1.10 else '  ABOVE TARGET'}")
    path = write_json("step.json", {"args": vars(args), "environment": env, "results": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
