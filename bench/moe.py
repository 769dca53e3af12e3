"""MoE step time over dense step time at equal active parameters: 4 and 8 experts, top-1 and top-2.

    python -m bench.moe                          # hidden 512, 4 layers, seq 256, micro-batch 8, fp32 and bf16
    python -m bench.moe --dtype bf16 --steps 8   # one dtype, more steps
    python -m bench.moe --dispatch split grouped # the MoE layer's two dispatches side by side (grouped / split)

Every MoE model has the dense model's active FFN width: with top-k routing each expert is 1/k of the
dense FFN (intermediate_size / k), so k experts per token do the dense FFN's matmul FLOPs; the
router is the only extra active weight. Each configuration runs `minilm.step.optimizer_step`
(accumulation 1: forward, backward, clip, AdamW, zero grad); all of them alternate step by step,
so background load hits each alike, and warm-up steps are not timed. The ratio is per dtype, of
median step times (and of the fastest steps). Target: <= 1.10x on CPU. With several --dispatch values
(minilm.model.MoEFeedForward.dispatch) every MoE configuration runs with each, and the ratio of the
grouped dispatch's median step to the split one's is printed too.
Writes moe.json to bench/results/ (or $MINILM_BENCH_RESULTS).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from minilm.config import ModelConfig, TrainConfig
from minilm.model import MiniMindForCausalLM, MoEFeedForward
from minilm.step import TORCH_DTYPES, make_grad_scaler, make_optimizer, optimizer_step

from .common import add_model_args, alternate, environment, write_json

TARGET = 1.10


def build(args, experts: int, top_k: int) -> MiniMindForCausalLM:
    """experts == 0: the dense model; else MoE with experts 1/top_k as wide as the dense FFN."""
    dense = ModelConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                        num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
                        vocab_size=args.vocab_size, max_position_embeddings=args.seq_len + 1)
    cfg = dense
    if experts:
        if dense.intermediate_size % top_k:
            raise SystemExit(f"intermediate size {dense.intermediate_size} is not divisible by top-k {top_k}")
        cfg = ModelConfig(**{**dense.to_dict(), "use_moe": True, "num_experts": experts,
                             "num_experts_per_tok": top_k, "intermediate_size": dense.intermediate_size // top_k})
    torch.manual_seed(0)
    return MiniMindForCausalLM(cfg).train()


def bench_dtype(args, dtype_name: str) -> dict:
    dtype = TORCH_DTYPES[dtype_name]
    named = len(args.dispatch) > 1 or args.dispatch != ["auto"]
    configs = [("dense", 0, 1, "auto")] + [(f"moe {e}x top-{k}" + (f" {d}" if named else ""), e, k, d)
                                           for e in args.experts for k in args.top_k for d in args.dispatch]
    runs = {}
    for name, experts, top_k, dispatch in configs:
        model = build(args, experts, top_k)
        gen = torch.Generator().manual_seed(1)  # every configuration sees the same token batches
        runs[name] = {"model": model, "experts": experts, "top_k": top_k if experts else None, "dispatch": dispatch,
                      "optimizer": make_optimizer(model, TrainConfig(optimizer="adamw", lr=1e-4)),
                      "scaler": make_grad_scaler(dtype, "cpu"),
                      "batches": [torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_len + 1),
                                                generator=gen) for _ in range(args.warmup + args.steps)]}

    def step_fn(r):
        def step(i: int) -> None:
            MoEFeedForward.dispatch = r["dispatch"]
            m = optimizer_step(r["model"], r["optimizer"], r["scaler"], [r["batches"][i]], lr=1e-4, grad_clip=1.0,
                               dtype=dtype)
            float(m.loss)
        return step

    times = alternate({name: step_fn(r) for name, r in runs.items()}, args.steps, args.warmup)
    dense_median, dense_min = statistics.median(times["dense"]), min(times["dense"])
    rows = []
    for name, r in runs.items():
        t, model = times[name], r["model"]
        load = model.expert_load()
        rows.append({"config": name, "dtype": dtype_name, "experts": r["experts"], "top_k": r["top_k"],
                     "dispatch": r["dispatch"] if r["experts"] else None,
                     "params": model.num_params(), "active_params": model.num_params(active=True),
                     "step_s_median": statistics.median(t), "step_s_min": min(t), "step_s_all": t,
                     "over_dense": statistics.median(t) / dense_median, "over_dense_min": min(t) / dense_min,
                     "max_expert_share": float(load.max()) if load is not None else None})
    MoEFeedForward.dispatch = "auto"
    return {"dtype": dtype_name, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.moe", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--experts", type=int, nargs="+", default=[4, 8])
    p.add_argument("--top-k", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps per configuration")
    p.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps per configuration first")
    p.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="both")
    p.add_argument("--dispatch", nargs="+", choices=["auto", "split", "grouped"], default=["auto"],
                   help="the MoE layer's dispatch(es) to time (several: side by side)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if any(k < 1 or k > e for e in args.experts for k in args.top_k):
        p.error("every --top-k must be in [1, every --experts]")
    if args.threads:
        torch.set_num_threads(args.threads)

    env = environment()
    print(f"# {env['cpu']}, {env['torch_threads']} torch threads, torch {env['torch']}, "
          f"load average {env['load_average']}")
    print(f"# hidden {args.hidden_size}, layers {args.num_hidden_layers}, seq {args.seq_len}, micro-batch "
          f"{args.micro_batch_size}; expert FFN width = dense width / top-k; {args.steps} timed steps after "
          f"{args.warmup} warm-up, all configurations alternating")
    results = [bench_dtype(args, d) for d in (("fp32", "bf16") if args.dtype == "both" else (args.dtype,))]

    header = (f"{'config':<22} {'dtype':<5} {'params':>8} {'active':>8} {'step s':>8} {'min s':>8} "
              f"{'/dense':>7} {'best':>6} {'max load':>8}")
    print(header)
    print("-" * len(header))
    for res in results:
        for r in res["rows"]:
            share = f"{r['max_expert_share']:.2f}" if r["max_expert_share"] is not None else "-"
            print(f"{r['config']:<22} {r['dtype']:<5} {r['params'] / 1e6:>7.1f}M {r['active_params'] / 1e6:>7.1f}M "
                  f"{r['step_s_median']:>8.3f} {r['step_s_min']:>8.3f} {r['over_dense']:>6.2f}x "
                  f"{r['over_dense_min']:>5.2f}x {share:>8}")
    print("/dense = median MoE step / median dense step; best = fastest / fastest; max load = largest share of "
          "routed tokens one expert got in the last step (one layer)")
    for res in results:
        for r in res["rows"][1:]:
            verdict = "" if r["over_dense"] <= TARGET else "  ABOVE TARGET"
            dispatch = f", {r['dispatch']} dispatch" if r["dispatch"] != "auto" else ""
            print(f"MoE / dense step time ({r['dtype']}, {r['experts']} experts, top-{r['top_k']}{dispatch}): "
                  f"{r['over_dense']:.2f}x median, {r['over_dense_min']:.2f}x best (target <= {TARGET:.2f}x){verdict}")
    for res in results:
        by_name = {r["config"]: r for r in res["rows"]}
        for r in res["rows"]:
            split = by_name.get(r["config"].removesuffix(" grouped") + " split")
            if r["dispatch"] == "grouped" and split:
                print(f"grouped / split dispatch step time ({r['dtype']}, {r['experts']} experts, top-{r['top_k']}): "
                      f"{r['step_s_median'] / split['step_s_median']:.2f}x median, "
                      f"{r['step_s_min'] / split['step_s_min']:.2f}x best")
    path = write_json("moe.json", {"args": vars(args), "environment": env, "results": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
