"""Throughput and MFU of one optimizer step: dense vs MoE at equal active parameters, eager vs compiled, on the same
batches, alternating step by step (`common.alternate`); `--estimate h200`: each phase's time on an H200 and the MFU
range it predicts. The GPU check's rows use the same `build`, `stepper` and `figures`. Writes step.json."""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from minilm import loss as L
from minilm import model as M
from minilm.config import ModelConfig, TrainConfig
from minilm.model import MiniMindForCausalLM, MoEFeedForward
from minilm.progress import datasheet_peak, measured_matmul_peak
from minilm.step import TORCH_DTYPES, configure_backends, make_grad_scaler, optimizer_step

from .common import add_model_args, alternate, build, environment, machine, table, write_json
from .common import model_config as dense_config

MFU_GOALS = {"26m": 0.30, "104m": 0.45}  # compiled bf16, H100/H200 class (nanochat: ~46% at its d18)
MOE_TARGET = 1.10  # MoE / dense step time on CPU
SUFFIX = {"off": "", "blocks": "+compile", "model": "+compile-model"}  # a row's name: its --compile mode


def model_config(args, experts: int = 0, top_k: int = 1, document_mask: bool = False) -> ModelConfig:
    """The dense model of the flags, or MoE with experts 1/top_k as wide as its FFN (the same active FLOPs)."""
    dense = dense_config(args, document_mask=document_mask)
    if not experts:
        return dense
    if dense.intermediate_size % top_k:
        raise SystemExit(f"error: intermediate size {dense.intermediate_size} is not divisible by top-k {top_k}")
    return ModelConfig(**{**dense.to_dict(), "use_moe": True, "num_experts": experts, "num_experts_per_tok": top_k,
                          "intermediate_size": dense.intermediate_size // top_k})


def random_batches(args, n: int, device: torch.device) -> list[torch.Tensor]:
    """n micro-batches of seq_len + 1 ids (row[:, :-1] fed, row[:, 1:] scored), the same for every configuration."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_len + 1), generator=gen).to(device)
            for _ in range(n)]


def stepper(model, optimizer, batches, dtype, dispatch: str = "auto", projections: str = "auto"):
    """step(i): optimizer step i on batches[i], done when its loss is on the host."""
    scaler = make_grad_scaler(dtype, batches[0].device.type)

    def step(i: int) -> None:
        MoEFeedForward.dispatch, M.PROJECTIONS = dispatch, projections
        float(optimizer_step(model, optimizer, scaler, [batches[i]], lr=1e-4, grad_clip=1.0, dtype=dtype).loss)
    return step


def figures(model, times: list[float], args, peak: float, sheet: float | None) -> dict:
    """A row's figures from its timed steps: step time, tokens/s, MFU (measured and data-sheet peak), expert load."""
    step_s, tokens, load = statistics.median(times), args.micro_batch_size * args.seq_len, model.expert_load()
    mfu = lambda s, p: model.estimate_mfu(tokens / s, args.seq_len, p)  # noqa: E731
    return {"params": model.num_params(), "active_params": model.num_params(active=True),
            "flops_per_token": model.flops_per_token(args.seq_len), "tokens_per_step": tokens,
            "step_s_median": step_s, "step_s_min": min(times), "step_s_max": max(times), "step_s_all": times,
            "tokens_per_s": tokens / step_s, "achieved_flops": model.flops_per_token(args.seq_len) * tokens / step_s,
            "peak_flops": peak, "peak_flops_datasheet": sheet, "mfu": mfu(step_s, peak),
            "mfu_best_step": mfu(min(times), peak), "mfu_datasheet": mfu(step_s, sheet) if sheet else None,
            "max_expert_share": float(load.max()) if load is not None else None}


def configs(args) -> list[tuple[str, int, int, str, str, str, str]]:
    """(name, experts, top-k, dispatch, compile, optimizer, projections): dense, each MoE, each compiled (each
    --compile mode), each further optimizer, each further projections mode."""
    named = args.dispatch != ["auto"]
    moe = [(f"moe {e}x top-{k}" + (f" {d}" if named else ""), e, k, d)
           for e in ([] if args.no_moe else args.experts) for k in args.top_k for d in args.dispatch]
    eager = [("dense", 0, 1, "auto"), *moe]
    modes = (args.compile or ["blocks"]) if args.compile is not None else []  # a bare --compile: blocks
    compiled = [(c[0] + SUFFIX[mode], *c[1:], mode) for mode in modes for c in eager]
    first, proj = args.optimizer[0], args.projections[0]
    return ([(*c, "off", first, proj) for c in eager] + [(*c, first, proj) for c in compiled]
            + [(f"dense {opt}", 0, 1, "auto", "off", opt, proj) for opt in args.optimizer[1:]]
            + [(f"dense {p}", 0, 1, "auto", "off", first, p) for p in args.projections[1:]])


def bench_dtype(args, dtype_name: str) -> dict:
    dtype, device = TORCH_DTYPES[dtype_name], torch.device(args.device)
    peak_before = measured_matmul_peak(dtype, n=args.peak_size, repeats=10, device=device)
    batches = random_batches(args, args.warmup + args.steps, device)
    runs, steps = {}, {}
    for name, experts, top_k, dispatch, compile_, opt, projections in configs(args):
        model, optimizer = build(model_config(args, experts, top_k), TrainConfig(lr=1e-4, compile=compile_,
                                                                                 optimizer=opt), device)
        runs[name] = (model, experts, top_k, dispatch, compile_, projections)
        steps[name] = stepper(model, optimizer, batches, dtype, dispatch, projections)
    times = alternate(steps, args.steps, args.warmup, device)
    MoEFeedForward.dispatch, M.PROJECTIONS = "auto", "auto"  # the process's defaults, as they were
    peak_after = measured_matmul_peak(dtype, n=args.peak_size, repeats=10, device=device)
    peak = max(peak_before, peak_after)  # the less disturbed by other load on the host
    sheet = datasheet_peak(torch.cuda.get_device_name(device), dtype) if device.type == "cuda" else None
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for name, (model, experts, top_k, dispatch, compile_, projections) in runs.items():
        dense = "dense" + SUFFIX[compile_]
        rows.append({"config": name, "dtype": dtype_name, "compile": compile_, "experts": experts,
                     "top_k": top_k if experts else None, "dispatch": dispatch if experts else None,
                     "projections": projections,
                     **figures(model, times[name], args, peak, sheet), "over_dense": med[name] / med[dense],
                     "over_dense_min": min(times[name]) / min(times[dense]),  # > 1: compile made the step faster
                     "compile_speedup": med[name.removesuffix(SUFFIX[compile_])] / med[name]
                     if compile_ != "off" else None})
    return {"dtype": dtype_name, "peak_flops": peak, "peak_flops_before": peak_before, "peak_flops_after": peak_after,
            "peak_flops_datasheet": sheet, "rows": rows}


def print_results(results: list[dict], args) -> None:
    print("step s = median optimizer step; MFU from the median, best = of the fastest step; /dense = median step "
          "over the dense one's (same compile)")
    print(table(["config", "dtype", "params", "active", "step s", "min s", "tokens/s", "GFLOP/s", "MFU", "best",
                 "/dense"], [[r["config"], r["dtype"], f"{r['params'] / 1e6:.1f}M", f"{r['active_params'] / 1e6:.1f}M",
                              f"{r['step_s_median']:.4f}", f"{r['step_s_min']:.4f}", f"{r['tokens_per_s']:.0f}",
                              f"{r['achieved_flops'] / 1e9:.1f}", f"{r['mfu']:.1%}", f"{r['mfu_best_step']:.1%}",
                              f"{r['over_dense']:.2f}x"] for res in results for r in res["rows"]], left=2))
    for res in results:
        print(f"matmul peak ({res['dtype']}, {args.peak_size}^3, best of 10): {res['peak_flops_before'] / 1e9:.1f} "
              f"GFLOP/s before, {res['peak_flops_after'] / 1e9:.1f} after the steps; MFU uses the larger")
        if res["peak_flops_datasheet"]:
            print(f"  against the data-sheet peak ({res['peak_flops_datasheet'] / 1e12:.1f} TFLOP/s): MFU "
                  + ", ".join(f"{r['config']} {r['mfu_datasheet']:.1%}" for r in res["rows"]))
        if any(r["mfu"] > 1 for r in res["rows"]):
            print("  warning: MFU > 100%: the peak was measured while the host was busier than during the steps")
        by_name = {r["config"]: r for r in res["rows"]}
        for r in res["rows"]:
            how = f"{res['dtype']}{', compiled' if r['compile'] != 'off' else ''}, {r['experts']} experts, top-{r['top_k']}"
            if r["experts"]:
                dispatch = f", {r['dispatch']} dispatch" if r["dispatch"] != "auto" else ""
                print(f"MoE / dense step time ({how}{dispatch}): {r['over_dense']:.2f}x median, "
                      f"{r['over_dense_min']:.2f}x best (target <= {MOE_TARGET:.2f}x)"
                      + ("" if r["over_dense"] <= MOE_TARGET else "  ABOVE TARGET"))
            split = by_name.get(r["config"].replace(" grouped", " split"))
            if r["dispatch"] == "grouped" and split:
                print(f"grouped / split dispatch step time ({how}): {r['step_s_median'] / split['step_s_median']:.2f}x"
                      f" median, {r['step_s_min'] / split['step_s_min']:.2f}x best")
            if r["compile"] != "off":
                print(f"compile speed-up, eager / compiled step ({res['dtype']}, {r['config']}; > 1: compile is "
                      f"faster): {r['compile_speedup']:.2f}x median")


# ---- --estimate: each phase's time on a GPU, added up, and the MFU range it predicts ------------------------

# H200 SXM, bf16. Ceilings (not reached by this step): the data sheet's, and as measured on the lent machine (an
# 8192^3 matmul, a device copy). The rates the phases run at, (fast, mid, slow), are assumptions until a lent GPU
# measures them: GEMMs with K = hidden run below the large-GEMM rate; FA2's flash kernel at these shapes; Inductor's
# elementwise kernels at 65-90% of the copy rate.
HARDWARE = {"h200": {"name": "NVIDIA H200", "bf16_datasheet": 989.5e12, "bf16_measured": 790e12,
                     "hbm_datasheet": 4.8e12, "hbm_measured": 4.3e12, "launch_s": 5e-6,
                     "gemm": {768: (660e12, 600e12, 540e12), 512: (600e12, 520e12, 440e12)},
                     "attention": (180e12, 140e12, 110e12), "hbm": (3.9e12, 3.4e12, 2.8e12)}}
# The GPU check's two shapes (bench/gpu_plan.py GPU): (name, hidden, layers, micro-batch), seq 512, vocab 6400
ESTIMATE_SIZES = (("26m", 512, 8, 32), ("104m", 768, 16, 128))


def phase_work(cfg: ModelConfig, batch: int, seq: int) -> list[tuple[str, str, float, float]]:
    """(phase, how it runs, FLOPs, bytes) of one bf16 optimizer step as the GPU check's headline rows run it (`--compile
    model`: the forward with the chunked head and loss one graph; q|k|v and gate|up fused on CUDA; fused AdamW). How: "gemm" and "attention" at their rate
    (their own reads and writes inside it), "memory" at the bandwidth, "gemm+memory" the two one after the other."""
    n, h, i, v, layers = batch * seq, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * cfg.head_dim
    block_params = h * (h + 2 * kv) + h * h + 3 * h * i  # q, k, v, o, gate, up, down
    params = layers * (block_params + 2 * h + 2 * cfg.head_dim) + v * h + h
    bf16, f32 = 2, 4
    # Each matmul reads its input and writes its output in the forward; the backward reads the output's gradient
    # and the input again and writes the input's gradient: ~3x the forward's activation bytes.
    matmul_bytes = 3 * bf16 * n * layers * (h + (h + 2 * kv) + h + h + h + 2 * i + i + h)
    # Elementwise work per layer and token (values read + written, bf16), what Inductor's fusion still leaves
    # between the matmuls: the two RMSNorms, the q/k norms and RoPE, the two residual adds, SwiGLU's silu * up; the
    # backward about twice the forward (~106 GB a step at 104M).
    elementwise = 3 * bf16 * n * layers * (2 * h + 2 * h + 2 * (h + 2 * kv) + 2 * 3 * h + 3 * i)
    attention_flops = layers * 3.5 * 2 * batch * cfg.num_attention_heads * seq * seq * cfg.head_dim  # causal
    # The chunked head in the compiled graph: its bf16 logits written, read for logsumexp and again for softmax -
    # one-hot, written as the bf16 gradient and read by its two matmuls (~10 bytes per logit; eager, with its fp32
    # copies, ~34), between its three matmuls, none overlapping.
    head_bytes = 10 * n * v + 3 * bf16 * n * h
    # Per parameter: autocast's bf16 copy (read fp32, write bf16), the gradient's cast and accumulation, the clip's
    # norm and scaling, fused AdamW (param, grad, two moments read; param and moments written).
    weight_bytes = params * (f32 + bf16 + bf16 + f32 + 2 * f32 + 3 * f32 + 4 * f32 + 3 * f32)
    return [("block matmuls (q, k, v, o, gate, up, down), fwd + bwd", "gemm", 6 * n * layers * block_params,
             matmul_bytes),
            ("attention (flash, causal), fwd + bwd", "attention", attention_flops,
             4 * bf16 * n * layers * (h + 2 * kv) * 3),
            ("norms, RoPE, SwiGLU, residual, fwd + bwd", "memory", 0, elementwise),
            ("head matmuls + chunked cross entropy (compiled)", "gemm+memory", 6 * n * h * v, head_bytes),
            ("embedding lookup + its gradient", "memory", 0, n * h * (f32 + bf16 + f32) + v * h * f32),
            ("weights: bf16 casts, grad, clip, fused AdamW", "memory", 0, weight_bytes)]


def estimate_phases(cfg: ModelConfig, batch: int, seq: int, hw: dict) -> list[dict]:
    """Each phase's time at the fast, mid and slow rates (compute_s + memory_s at mid = time_s; `range_s` fast to
    slow), and the host's kernel launches, which overlap the device's work."""
    out, gemm = [], hw["gemm"][min(hw["gemm"], key=lambda k: abs(k - cfg.hidden_size))]
    for name, how, flops, nbytes in phase_work(cfg, batch, seq):
        rate = hw["attention"] if how == "attention" else gemm
        times = [(flops / rate[c] if how != "memory" else 0.0, nbytes / hw["hbm"][c] if "memory" in how else 0.0)
                 for c in range(3)]
        out.append({"phase": name, "runs": how, "flops": flops, "bytes": nbytes, "compute_s": times[1][0],
                    "memory_s": times[1][1], "time_s": sum(times[1]), "range_s": [sum(times[0]), sum(times[2])],
                    "bound": "memory" if how == "memory" else "compute" if how != "gemm+memory" else "both"})
    kernels = cfg.num_hidden_layers * 50 + 15 * -(-batch * seq * cfg.vocab_size // L.HEAD_CHUNK_LOGITS) + 40
    host = kernels * hw["launch_s"]
    out.append({"phase": f"host: ~{kernels} kernel launches (overlap the device's work)", "runs": "host", "flops": 0,
                "bytes": 0, "compute_s": 0.0, "memory_s": 0.0, "time_s": host, "range_s": [host, host], "bound": "host"})
    return out


def estimate_size(args, name: str, hidden: int, layers: int, batch: int, hw: dict) -> dict:
    args = argparse.Namespace(**{**vars(args), "hidden_size": hidden, "num_hidden_layers": layers})
    cfg = dense_config(args)
    model, seq, tokens = MiniMindForCausalLM(cfg), args.seq_len, batch * args.seq_len
    phases = estimate_phases(cfg, batch, seq, hw)
    device, host = phases[:-1], phases[-1]["time_s"]
    step_s = max(sum(p["time_s"] for p in device), host)
    step_range = [max(sum(p["range_s"][k] for p in device), host) for k in (0, 1)]
    mfu = [model.estimate_mfu(tokens / t, seq, hw["bf16_datasheet"]) for t in (step_s, *step_range)]
    print(f"\n{name}: hidden {hidden}, {layers} layers, {cfg.num_attention_heads}/{cfg.num_key_value_heads} heads of "
          f"dim {cfg.head_dim}, vocab {cfg.vocab_size}, {model.num_params() / 1e6:.1f}M parameters; micro-batch "
          f"{batch} x seq {seq} = {tokens:,} tokens; compiled bf16 step")
    print(table(["phase", "TFLOP", "GB", "compute ms", "memory ms", "time ms", "range ms"], [
        [p["phase"], f"{p['flops'] / 1e12:.2f}", f"{p['bytes'] / 1e9:.2f}", f"{p['compute_s'] * 1e3:.2f}",
         f"{p['memory_s'] * 1e3:.2f}", f"{p['time_s'] * 1e3:.2f}",
         f"{p['range_s'][0] * 1e3:.2f}-{p['range_s'][1] * 1e3:.2f}"] for p in phases]))
    print(f"  predicted step {step_s * 1e3:.1f} ms ({step_range[0] * 1e3:.1f}-{step_range[1] * 1e3:.1f}), "
          f"{tokens / step_s:,.0f} tokens/s; model FLOPs {model.flops_per_token(seq) * tokens / 1e12:.1f} "
          f"TFLOP (minilm's 6N + 12LHT per token); predicted MFU {mfu[0]:.1%} of the data sheet (range "
          f"{mfu[2]:.1%}-{mfu[1]:.1%}; goal {MFU_GOALS[name]:.0%}): the phases added, each at the rate it runs at")
    return {"size": name, "hidden": hidden, "layers": layers, "micro_batch": batch, "seq_len": seq,
            "params": model.num_params(), "phases": phases, "step_s": step_s, "step_s_range": step_range,
            "tokens_per_s": tokens / step_s, "mfu_datasheet": mfu[0], "mfu_datasheet_range": [mfu[2], mfu[1]]}


def estimate_main(args) -> int:
    hw, rates = HARDWARE[args.estimate], lambda rs, d=0: "-".join(f"{r / 1e12:.{d}f}" for r in rs)
    print(f"# {hw['name']}: ceilings bf16 {hw['bf16_datasheet'] / 1e12:.0f} TFLOP/s data sheet, "
          f"{hw['bf16_measured'] / 1e12:.0f} measured (the roofline of a large GEMM), HBM "
          f"{hw['hbm_datasheet'] / 1e12:.1f} TB/s data sheet, {hw['hbm_measured'] / 1e12:.1f} measured; the phases "
          f"run at (fast-mid-slow) GEMMs " + ", ".join(f"at K = {k} {rates(r)}" for k, r in hw["gemm"].items())
          + f" TFLOP/s, flash attention (FA2) {rates(hw['attention'])} TFLOP/s, elementwise {rates(hw['hbm'], 1)} TB/s")
    write_json("step-estimate.json", {"hardware": hw, "sizes": [estimate_size(args, *s, hw) for s in ESTIMATE_SIZES]})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__)
    add_model_args(p)
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps per config")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per config first (with --compile: compiling)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="fp32")
    p.add_argument("--device", default="cpu", help="cpu or cuda (one GPU)")
    p.add_argument("--compile", nargs="*", choices=["blocks", "model"], default=None,
                   help="add rows with torch.compile: blocks (a bare --compile), model (the whole forward and loss), "
                        "or both")
    p.add_argument("--optimizer", nargs="+", choices=["muon", "adamw"], default=["muon"],
                   help="every row's optimizer (the first, as the loop's); each further one adds a dense row")
    p.add_argument("--experts", type=int, nargs="+", default=[4], help="the MoE rows' expert counts")
    p.add_argument("--top-k", type=int, nargs="+", default=[1], help="the MoE rows' experts per token")
    p.add_argument("--dispatch", nargs="+", choices=["auto", "split", "grouped"], default=["auto"],
                   help="the MoE layer's dispatch(es) to time (minilm.model.MoEFeedForward.dispatch)")
    p.add_argument("--projections", nargs="+", choices=["auto", "fused", "split"], default=["auto"],
                   help="q|k|v and gate|up as one matmul each or not (minilm.model.PROJECTIONS): every row's the "
                        "first; each further one adds a dense row")
    p.add_argument("--no-moe", action="store_true", help="the dense model only (no MoE rows)")
    p.add_argument("--peak-size", type=int, default=None, help="n of the n^3 matmul peak (default 2048 CPU, 8192 GPU)")
    p.add_argument("--estimate", choices=sorted(HARDWARE), default=None,
                   help="print each phase's predicted time and the MFU range on that GPU (nothing is run)")
    args = p.parse_args(argv)
    if args.estimate:
        args.seq_len = 512 if "--seq-len" not in (argv or sys.argv) else args.seq_len  # the GPU check's
        return estimate_main(args)
    if args.steps < 1 or args.warmup < 0 or any(k < 1 or k > e for e in args.experts for k in args.top_k):
        p.error("--steps must be >= 1, --warmup >= 0 and every --top-k in [1, every --experts]")
    device = torch.device(args.device)
    if device.type not in ("cpu", "cuda") or device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device must be cpu or cuda (a CUDA device this torch sees)")
    args.peak_size = args.peak_size or (8192 if device.type == "cuda" else 2048)
    configure_backends(device)  # TF32 on Ampere+ GPUs; nothing on CPU
    env = environment()
    print(machine(env, device.type == "cuda"))
    print(f"# hidden {args.hidden_size}, layers {args.num_hidden_layers}, vocab {args.vocab_size}, seq {args.seq_len}, "
          f"micro-batch {args.micro_batch_size}, accumulation 1, {args.steps} timed steps after {args.warmup} warm-up, "
          f"device {args.device}")
    results = [bench_dtype(args, d) for d in (("fp32", "bf16") if args.dtype == "both" else (args.dtype,))]
    print_results(results, args)
    write_json("step.json", {"args": vars(args), "environment": env, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
