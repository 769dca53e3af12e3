"""Throughput and MFU of one optimizer step, dense vs MoE with the same active parameters (CPU or one GPU).

    python -m bench.step                                   # hidden 512, 4 layers, seq 256, micro-batch 8, fp32, CPU
    python -m bench.step --steps 4 --warmup 1              # quicker
    python -m bench.step --dtype both                      # add a bf16-autocast pair of rows
    python -m bench.step --compile                         # add torch.compile'd rows (minilm.step.prepare_model)
    python -m bench.step --device cuda --dtype bf16 --compile --hidden-size 768 --num-hidden-layers 16 --seq-len 1024
    python -m bench.step --no-moe ...                      # the dense model only (bench/gpu_check.sh)
    python -m bench.step --ab positions --dtype bf16       # one change of the GPU step, before vs after (below)
    python -m bench.step --estimate h200                   # the roofline of each phase and the predicted MFU

For each dtype it measures, in this process: the matmul peak (n^3, best of 10, before and after the
steps; the larger counts; n = 2048 on CPU, 8192 on GPU) and `minilm.step.optimizer_step`
(accumulation 1) for the dense model and for the MoE model (4 experts, top-1: the same active FFN
width), and with --compile for both again with `prepare_model(compile=True)`. All configurations
alternate step by step, so background load hits them alike; warm-up steps (which include the
compilation) are excluded. MFU = flops_per_token(seq_len) * tokens/s / measured peak; on a GPU listed in
minilm.progress.GPU_PEAK_BF16 also against its data-sheet peak (the figure the training loop's MFU uses).
Writes step.json to bench/results/ (or $MINILM_BENCH_RESULTS).

--ab CHANGE: the step as it is ("after") against the same step with that one change undone ("before", the
code it replaced, kept below), the two models built alike and alternating step by step on the same batches,
dense, accumulation 1: the ratio of their median steps (> 1: the change is faster) and the largest relative
difference of their losses. CHANGE is one of AB_CHANGES:
  positions    seq_len positions fed and scored (before: the row's seq_len + 1, the last output dropped)
  chunked-ce   the head and loss chunk by chunk, gradients in the forward (before: fp32 logits of the batch)
  residual     the residual stream in autocast's dtype (before: fp32, the embedding's output dtype)
  gqa          SDPA's own GQA (before: K and V repeated to every query head)
  bucket-view  DDP's gradient_as_bucket_view (a 1-rank gloo group; before: gradients copied to the buckets)
  muon         Muon's update batched by shape (before: a loop over the parameters); --optimizer muon

--estimate h200: nothing runs. For the GPU check's 26M and 104M rows (seq 512, vocab 6400, the heads of
--num-attention-heads / --num-key-value-heads), the FLOPs and bytes of each phase of a compiled bf16 step, each
phase's roofline time against the H200's ceilings (KINDS.md's measured 790 TFLOP/s and 4.3 TB/s; flash attention
at ATTENTION_EFFICIENCY of the matmul rate), their sum as the predicted step, and the predicted MFU (minilm's
6N + 12LHT FLOPs per token over the 989.5 TFLOP/s data sheet): the first GPU run compares its rows and its
profiled step's kernels against these, phase by phase. Writes step-estimate.json.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import statistics
import sys
import tempfile

import torch
import torch.nn.functional as F

from minilm import loss as L
from minilm import model as M
from minilm.config import ModelConfig, TrainConfig
from minilm.distributed import leave_process_group
from minilm.model import CausalLMOutput, MiniMindForCausalLM
from minilm.muon import NS_COEFFICIENTS
from minilm.progress import datasheet_peak, measured_matmul_peak
from minilm.step import (
    DTYPE_NAMES,
    TORCH_DTYPES,
    configure_backends,
    make_grad_scaler,
    make_optimizer,
    optimizer_step,
    prepare_model,
)

from .common import add_model_args, alternate, environment, write_json
from .gpu_check import MFU_GOALS


def build(args, use_moe: bool, compile_: bool) -> MiniMindForCausalLM:
    # A micro-batch row is seq_len + 1 ids: row[:, :-1] fed, row[:, 1:] scored.
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                      num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
                      vocab_size=args.vocab_size, max_position_embeddings=args.seq_len + 1, use_moe=use_moe,
                      num_experts=4, num_experts_per_tok=1)
    model = MiniMindForCausalLM(cfg).to(args.device).train()
    return prepare_model(model, TrainConfig(compile=compile_), args.device)


def bench_dtype(args, dtype_name: str) -> dict:
    dtype = TORCH_DTYPES[dtype_name]
    device = torch.device(args.device)
    peak_before = measured_matmul_peak(dtype, n=args.peak_size, repeats=10, device=device)
    configs = [("dense", False, False)] + ([] if args.no_moe else [("moe", True, False)])
    if args.compile:
        configs += [("dense+compile", False, True)] + ([] if args.no_moe else [("moe+compile", True, True)])
    runs = {}
    for name, use_moe, compile_ in configs:
        model = build(args, use_moe, compile_)
        gen = torch.Generator().manual_seed(1)
        runs[name] = {
            "model": model, "compile": compile_,
            "optimizer": make_optimizer(model, TrainConfig(optimizer="adamw", lr=1e-4)),
            "scaler": make_grad_scaler(dtype, device.type),
            "batches": [torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_len + 1),
                                      generator=gen).to(device) for _ in range(args.warmup + args.steps)],
        }

    def step_fn(r):
        def step(i: int) -> None:
            m = optimizer_step(r["model"], r["optimizer"], r["scaler"], [r["batches"][i]], lr=1e-4, grad_clip=1.0,
                               dtype=dtype)
            float(m.loss)  # the step is done when its loss is on the host
        return step

    times = alternate({name: step_fn(r) for name, r in runs.items()}, args.steps, args.warmup, device)
    # Measured before and after the steps; the larger is the less disturbed by other load on the host.
    peak_after = measured_matmul_peak(dtype, n=args.peak_size, repeats=10, device=device)
    peak = max(peak_before, peak_after)
    sheet = datasheet_peak(torch.cuda.get_device_name(device), dtype) if device.type == "cuda" else None
    rows = []
    tokens = args.micro_batch_size * args.seq_len
    for name, r in runs.items():
        model, t = r["model"], times[name]
        step_s = statistics.median(t)
        tps = tokens / step_s
        load = model.expert_load()
        rows.append({
            "config": name, "dtype": dtype_name, "compile": r["compile"],
            "params": model.num_params(), "active_params": model.num_params(active=True),
            "flops_per_token": model.flops_per_token(args.seq_len),
            "step_s_median": step_s, "step_s_min": min(t), "step_s_max": max(t), "step_s_all": t,
            "tokens_per_step": tokens, "tokens_per_s": tps,
            "achieved_flops": model.flops_per_token(args.seq_len) * tps,
            "mfu": model.estimate_mfu(tps, args.seq_len, peak),
            "mfu_best_step": model.estimate_mfu(tokens / min(t), args.seq_len, peak),
            "mfu_datasheet": model.estimate_mfu(tps, args.seq_len, sheet) if sheet else None,
            "max_expert_share": float(load.max()) if load is not None else None,
        })
    by = {r["config"]: r for r in rows}
    ratios = {}
    if not args.no_moe:
        ratios.update({"moe_over_dense": by["moe"]["step_s_median"] / by["dense"]["step_s_median"],
                       "moe_over_dense_min": by["moe"]["step_s_min"] / by["dense"]["step_s_min"]})
    if args.compile:
        # > 1: compile made the step faster by that factor; < 1: slower
        ratios.update({"compile_speedup_dense": by["dense"]["step_s_median"] / by["dense+compile"]["step_s_median"],
                       "compile_speedup_dense_min": by["dense"]["step_s_min"] / by["dense+compile"]["step_s_min"]})
    if args.compile and not args.no_moe:
        ratios.update({
            "moe_over_dense_compiled": by["moe+compile"]["step_s_median"] / by["dense+compile"]["step_s_median"],
            "compile_speedup_moe": by["moe"]["step_s_median"] / by["moe+compile"]["step_s_median"],
            "compile_speedup_moe_min": by["moe"]["step_s_min"] / by["moe+compile"]["step_s_min"],
        })
    return {"dtype": dtype_name, "peak_flops": peak, "peak_flops_before": peak_before, "peak_flops_after": peak_after,
            "peak_flops_datasheet": sheet, "rows": rows, **ratios}


# ---- --ab: one change of the GPU step, before vs after ------------------------------------------------------------

AB_CHANGES = ("positions", "chunked-ce", "residual", "gqa", "bucket-view", "muon")


def forward_whole_rows(self, input_ids, labels=None, past_key_values=None, use_cache=False, targets=None,
                       reduction="mean"):
    """Before `positions`: the whole row (seq_len + 1 ids) through the model, the last position's output dropped."""
    hidden, _ = self.model(torch.cat([input_ids, targets[:, -1:]], dim=1))
    return CausalLMOutput(None, M.head_loss(hidden[:, :-1], self.lm_head.weight, targets, reduction),
                          self.aux_loss())


def head_loss_eager(hidden, weight, targets, reduction="mean"):
    """Before `chunked-ce`: the head over the whole batch, its logits in fp32, torch's cross entropy."""
    logits = F.linear(hidden, weight).float()
    nats = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction=reduction)
    return nats.view(targets.shape) if reduction == "none" else nats


def model_forward_fp32_residual(self, input_ids, past_key_values=None, use_cache=False):
    """Before `residual`: MiniMindModel.forward with the embedding's fp32 output as the residual stream."""
    t = input_ids.shape[1]
    cos, sin = self.freqs_cos[:t], self.freqs_sin[:t]
    x = self.dropout(self.embed_tokens(input_ids))
    mask = self.attention_mask(input_ids) if self.document_mask else None
    for layer in self.layers:
        x, _ = layer(x, cos, sin, None, False, mask)
    return self.norm(x), [None] * len(self.layers)


class LoopMuon(torch.optim.Optimizer):
    """Before `muon`: minilm.muon.Muon as it was, one parameter at a time (the same arithmetic)."""

    _step_supports_amp_scaling = True

    def __init__(self, params, lr, *, momentum=0.95, nesterov=True, ns_steps=5, betas=(0.9, 0.95), eps=1e-8,
                 weight_decay=0.0):
        super().__init__(params, {"lr": lr, "lr_ratio": 1.0, "weight_decay": weight_decay, "use_muon": False,
                                  "momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps,
                                  "betas": tuple(betas), "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        skip = getattr(self, "found_inf", None)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    (self._muon if group["use_muon"] else self._adamw)(p, group, skip)

    def _muon(self, p, group, skip):
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf, g, beta, lr = state["momentum_buffer"], p.grad, group["momentum"], group["lr"]
        new_buf = buf.lerp(g, 1 - beta)
        direction = g.lerp(new_buf, beta) if group["nesterov"] else new_buf
        a, b, c = NS_COEFFICIENTS
        x = direction.to(torch.bfloat16)
        wide = x.shape[0] > x.shape[1]
        x = x.T.contiguous() if wide else x
        x = x / (x.norm() + 1e-7)
        for _ in range(group["ns_steps"]):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        update = (x.T if wide else x).to(p.dtype) * max(1.0, p.shape[0] / p.shape[1]) ** 0.5
        self._commit(buf, new_buf, skip)
        self._commit(p, p * (1 - lr * group["weight_decay"]) - lr * update, skip)

    def _adamw(self, p, group, skip):
        state = self.state[p]
        if not state:
            state.update(step=torch.zeros((), device=p.device), exp_avg=torch.zeros_like(p),
                         exp_avg_sq=torch.zeros_like(p))
        (beta1, beta2), lr, g = group["betas"], group["lr"], p.grad
        step = state["step"] + 1
        exp_avg = state["exp_avg"].lerp(g, 1 - beta1)
        exp_avg_sq = state["exp_avg_sq"] * beta2 + (1 - beta2) * g * g
        denom = (exp_avg_sq / (1 - beta2 ** step)).sqrt() + group["eps"]
        new_p = p * (1 - lr * group["weight_decay"]) - lr * (exp_avg / (1 - beta1 ** step)) / denom
        for old, new in ((state["step"], step), (state["exp_avg"], exp_avg), (state["exp_avg_sq"], exp_avg_sq),
                         (p, new_p)):
            self._commit(old, new, skip)

    @staticmethod
    def _commit(old, new, skip):
        old.copy_(new if skip is None else torch.where(skip > 0, old, new))


class NoBucketView(torch.nn.parallel.DistributedDataParallel):
    """Before `bucket-view`: DDP copying each gradient into its bucket and back (what wrap_ddp asks for, less that)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "gradient_as_bucket_view": False})

    __init__.__signature__ = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__)


@contextlib.contextmanager
def patched(obj, name: str, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


# What undoes a change for the "before" arm's steps (bucket-view and muon: another DDP, another optimizer instead)
UNDO = {
    "positions": lambda: patched(MiniMindForCausalLM, "forward", forward_whole_rows),
    "chunked-ce": lambda: patched(M, "head_loss", head_loss_eager),
    "residual": lambda: patched(M.MiniMindModel, "forward", model_forward_fp32_residual),
    "gqa": lambda: patched(M, "SDPA_GQA", False),
}


def ab_arms(change: str, args):
    """{"before": (model, optimizer, context), "after": ...}: the same weights; the context undoes the change
    for the "before" arm's steps only."""
    from minilm.trainer import wrap_ddp

    train_cfg = TrainConfig(lr=1e-4, optimizer=args.optimizer)
    arms = {}
    for arm in ("before", "after"):
        model = build(args, use_moe=False, compile_=False)
        optimizer = make_optimizer(model, train_cfg)
        if arm == "before" and change == "muon":
            optimizer = LoopMuon(optimizer.param_groups, lr=train_cfg.lr)
        context = UNDO.get(change, contextlib.nullcontext) if arm == "before" else contextlib.nullcontext
        if change == "bucket-view":
            ddp = NoBucketView if arm == "before" else torch.nn.parallel.DistributedDataParallel
            with patched(torch.nn.parallel, "DistributedDataParallel", ddp):
                model = wrap_ddp(model, torch.device(args.device))
        arms[arm] = (model, optimizer, context)
    return arms


def ab_main(args) -> int:
    import torch.distributed as dist

    dtype = TORCH_DTYPES["bf16" if args.dtype == "both" else args.dtype]
    device = torch.device(args.device)
    group = tempfile.TemporaryDirectory() if args.ab == "bucket-view" else None
    if group:
        dist.init_process_group("gloo", init_method=f"file://{group.name}/rendezvous", rank=0, world_size=1)
    try:
        arms = ab_arms(args.ab, args)
        gen = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_len + 1), generator=gen)
                   .to(device) for _ in range(args.warmup + args.steps)]
        losses: dict[str, list[float]] = {arm: [] for arm in arms}

        def step_fn(arm):
            model, optimizer, context = arms[arm]
            scaler = make_grad_scaler(dtype, device.type)

            def step(i: int) -> None:
                with context():
                    m = optimizer_step(model, optimizer, scaler, [batches[i]], lr=1e-4, grad_clip=1.0, dtype=dtype)
                losses[arm].append(float(m.loss))
            return step

        times = alternate({arm: step_fn(arm) for arm in arms}, args.steps, args.warmup, device)
    finally:
        if group:
            arms = {}  # DDP goes while its group lives (gloo's destructor can hang after)
            leave_process_group()
            group.cleanup()
    before, after = (statistics.median(times[a]) for a in ("before", "after"))
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses["before"], losses["after"], strict=True))
    result = {"change": args.ab, "dtype": DTYPE_NAMES[dtype], "optimizer": args.optimizer,
              "step_s": {k: statistics.median(v) for k, v in times.items()}, "step_s_all": times,
              "before_over_after": before / after, "before_over_after_min": min(times["before"]) / min(times["after"]),
              "losses": losses, "max_relative_loss_difference": worst}
    print(f"--ab {args.ab} ({result['dtype']}, {result['optimizer']}): before {before:.4f} s, after {after:.4f} s "
          f"median step; before / after {before / after:.3f}x median, {result['before_over_after_min']:.3f}x best "
          f"(> 1: the change is faster); losses {losses['after'][0]:.5f} -> {losses['after'][-1]:.5f}, the arms "
          f"within {worst:.1e} (relative) over {len(losses['after'])} steps")
    path = write_json(f"step-ab-{args.ab}.json", {"args": vars(args), "environment": environment(), **result})
    print(f"wrote {path}")
    return 0


# ---- --estimate: the roofline of each phase on a GPU, and the MFU it predicts -------------------------------------

# The ceilings: H200 SXM, dense bf16 (fp32 accumulation) and HBM3e, from the data sheet and as KINDS.md measured them on
# the lent machine (an 8192^3 bf16 matmul: 769-798 TFLOP/s; a device-to-device copy: ~4.3 TB/s, reads + writes).
# PyTorch's flash attention (FlashAttention-2's kernels) at head dim 64 reaches about a third of the dense peak on
# Hopper (its authors' figures for the H100: ~330 TFLOP/s forward, less backward): ATTENTION_EFFICIENCY.
HARDWARE = {"h200": {"name": "NVIDIA H200", "bf16_datasheet": 989.5e12, "bf16_measured": 790e12,
                     "hbm_datasheet": 4.8e12, "hbm_measured": 4.3e12, "launch_s": 5e-6}}
ATTENTION_EFFICIENCY = 0.35
# The GPU check's two shapes (bench/gpu_check.py GPU): (name, hidden, layers, micro-batch), seq 512, vocab 6400
ESTIMATE_SIZES = (("26m", 512, 8, 32), ("104m", 768, 16, 128))


def estimate_phases(cfg: ModelConfig, batch: int, seq: int, hw: dict) -> list[dict]:
    """FLOPs and bytes of each phase of one compiled bf16 optimizer step (`prepare_model(compile=True)`: the
    blocks' elementwise work fused, the head chunked, fused AdamW), and each one's roofline time against the
    measured ceilings: max(FLOPs / matmul rate, bytes / bandwidth)."""
    n, h, i, v, layers = batch * seq, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * cfg.head_dim
    block_params = h * (h + 2 * kv) + h * h + 3 * h * i  # q, k, v, o, gate, up, down
    params = layers * (block_params + 2 * h + 2 * cfg.head_dim) + v * h + h
    bf16, f32 = 2, 4
    # Each matmul reads its input and writes its output in the forward; the backward reads the output's gradient
    # and the input again and writes the input's gradient: ~3x the forward's activation bytes.
    matmul_bytes = 3 * bf16 * n * layers * (h + (h + 2 * kv) + h + h + h + 2 * i + i + h)
    # Fused elementwise work per layer and token (values read + written, bf16): the two RMSNorms, the q/k norms and
    # RoPE, the two residual adds, SwiGLU's silu * up; the backward about twice the forward.
    elementwise = 3 * bf16 * n * layers * (2 * h + 2 * h + 2 * (h + 2 * kv) + 2 * 3 * h + 3 * i)
    attention_flops = layers * 3.5 * 2 * batch * cfg.num_attention_heads * seq * seq * cfg.head_dim  # causal
    # The chunked head: the logits in bf16, their fp32 copy, logsumexp, softmax - one-hot, its bf16 copy (~34 bytes
    # per logit over forward and gradient); its three matmuls are counted as FLOPs.
    head_bytes = 34 * n * v + 3 * bf16 * n * h
    # Per parameter: autocast's bf16 copy (read fp32, write bf16), the gradient's cast and accumulation, the clip's
    # norm and scaling, fused AdamW (param, grad, two moments read; param and moments written).
    weight_bytes = params * (f32 + bf16 + bf16 + f32 + 2 * f32 + 3 * f32 + 4 * f32 + 3 * f32)
    phases = [
        ("block matmuls (q, k, v, o, gate, up, down), fwd + bwd", 6 * n * layers * block_params, matmul_bytes, 1.0),
        ("attention (flash, causal), fwd + bwd", attention_flops, 4 * bf16 * n * layers * (h + 2 * kv) * 3,
         ATTENTION_EFFICIENCY),
        ("norms, RoPE, SwiGLU, residual (fused), fwd + bwd", 0, elementwise, 1.0),
        ("head matmul + chunked cross entropy", 6 * n * h * v, head_bytes, 1.0),
        ("embedding lookup + its gradient", 0, n * h * (f32 + bf16 + f32) + v * h * f32, 1.0),
        ("weights: bf16 casts, grad, clip, fused AdamW", 0, weight_bytes, 1.0),
    ]
    out = []
    for name, flops, nbytes, efficiency in phases:
        t_flops = flops / (hw["bf16_measured"] * efficiency)
        t_bytes = nbytes / hw["hbm_measured"]
        out.append({"phase": name, "flops": flops, "bytes": nbytes, "compute_s": t_flops, "memory_s": t_bytes,
                    "time_s": max(t_flops, t_bytes), "bound": "compute" if t_flops >= t_bytes else "memory"})
    # Kernel launches: the host queues them while the GPU works, so they cost time only if they outrun it.
    kernels = layers * 50 + 15 * -(-n * v // L.HEAD_CHUNK_LOGITS) + 40
    out.append({"phase": f"host: ~{kernels} kernel launches (overlap the device's work)", "flops": 0, "bytes": 0,
                "compute_s": 0.0, "memory_s": 0.0, "time_s": kernels * hw["launch_s"], "bound": "host"})
    return out


def estimate_main(args) -> int:
    hw = HARDWARE[args.estimate]
    print(f"# {hw['name']}: bf16 {hw['bf16_datasheet'] / 1e12:.0f} TFLOP/s data sheet, {hw['bf16_measured'] / 1e12:.0f} "
          f"measured; HBM {hw['hbm_datasheet'] / 1e12:.1f} TB/s data sheet, {hw['hbm_measured'] / 1e12:.1f} measured "
          f"(the roofline uses the measured); flash attention at {ATTENTION_EFFICIENCY:.0%} of the matmul rate")
    results = []
    for name, hidden, layers, batch in ESTIMATE_SIZES:
        cfg = ModelConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=args.num_attention_heads,
                          num_key_value_heads=args.num_key_value_heads, vocab_size=args.vocab_size,
                          max_position_embeddings=args.seq_len + 1)
        model = MiniMindForCausalLM(cfg)
        phases = estimate_phases(cfg, batch, args.seq_len, hw)
        device_s = sum(p["time_s"] for p in phases if p["bound"] != "host")
        step_s = max(device_s, phases[-1]["time_s"])
        tokens = batch * args.seq_len
        mfu = model.estimate_mfu(tokens / step_s, args.seq_len, hw["bf16_datasheet"])
        print(f"\n{name}: hidden {hidden}, {layers} layers, {cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, "
              f"vocab {cfg.vocab_size}, {model.num_params() / 1e6:.1f}M parameters; micro-batch {batch} x seq "
              f"{args.seq_len} = {tokens:,} tokens; compiled bf16 step")
        print(f"  {'phase':<52} {'TFLOP':>8} {'GB':>8} {'compute ms':>10} {'memory ms':>9} {'time ms':>8}  bound")
        for p in phases:
            print(f"  {p['phase']:<52} {p['flops'] / 1e12:>8.2f} {p['bytes'] / 1e9:>8.2f} {p['compute_s'] * 1e3:>10.2f} "
                  f"{p['memory_s'] * 1e3:>9.2f} {p['time_s'] * 1e3:>8.2f}  {p['bound']}")
        print(f"  predicted step {step_s * 1e3:.1f} ms, {tokens / step_s:,.0f} tokens/s; model FLOPs "
              f"{model.flops_per_token(args.seq_len) * tokens / 1e12:.1f} TFLOP (minilm's 6N + 12LHT per token); "
              f"predicted MFU {mfu:.1%} of the data sheet (goal {MFU_GOALS[name]:.0%}; every phase at its "
              f"ceiling, back to back: an upper bound the measured row is held against)")
        results.append({"size": name, "hidden": hidden, "layers": layers, "micro_batch": batch, "seq_len": args.seq_len,
                        "params": model.num_params(), "phases": phases, "step_s": step_s, "tokens_per_s": tokens / step_s,
                        "mfu_datasheet": mfu})
    print(f"\nwrote {write_json('step-estimate.json', {'hardware': hw, 'sizes': results})}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps per config")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps per config first "
                                                          "(with --compile they include the compilation)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="fp32")
    p.add_argument("--device", default="cpu", help="cpu or cuda (one GPU)")
    p.add_argument("--compile", action="store_true", help="add rows with torch.compile'd blocks")
    p.add_argument("--no-moe", action="store_true", help="the dense model only (no MoE rows)")
    p.add_argument("--peak-size", type=int, default=None, help="n of the n^3 matmul peak (default 2048 CPU, 8192 GPU)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--ab", choices=AB_CHANGES, default=None, help="one change of the GPU step, before vs after")
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw", help="--ab's optimizer")
    p.add_argument("--estimate", choices=sorted(HARDWARE), default=None,
                   help="print the roofline of each phase and the predicted MFU on that GPU (nothing is run)")
    args = p.parse_args(argv)
    if args.estimate:
        args.seq_len = 512 if "--seq-len" not in (argv or sys.argv) else args.seq_len  # the GPU check's
        return estimate_main(args)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this torch sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        p.error("--device must be cpu or cuda")
    args.peak_size = args.peak_size or (8192 if device.type == "cuda" else 2048)
    if args.threads:
        torch.set_num_threads(args.threads)
    configure_backends(device)  # TF32 on Ampere+ GPUs; nothing on CPU
    if args.ab:
        args.optimizer = "muon" if args.ab == "muon" else args.optimizer
        return ab_main(args)

    env = environment()
    where = env.get("gpu", "") if device.type == "cuda" else f"{env['cpu']}, {env['torch_threads']} torch threads"
    print(f"# {where}, torch {env['torch']}, load average {env['load_average']}")
    print(f"# hidden {args.hidden_size}, layers {args.num_hidden_layers}, vocab {args.vocab_size}, "
          f"seq {args.seq_len}, micro-batch {args.micro_batch_size}, accumulation 1, "
          f"{args.steps} timed steps after {args.warmup} warm-up, device {args.device}")
    results = [bench_dtype(args, d) for d in (("fp32", "bf16") if args.dtype == "both" else (args.dtype,))]

    header = (f"{'config':<14} {'dtype':<5} {'params':>8} {'active':>8} {'step s':>8} {'min s':>8} {'tokens/s':>10} "
              f"{'GFLOP/s':>9} {'peak':>9} {'MFU':>6} {'best':>6}")
    print("step s = median optimizer step; tokens/s, GFLOP/s and MFU from the median; best = MFU of the fastest "
          "step; peak = matmul GFLOP/s")
    print(header)
    print("-" * len(header))
    for res in results:
        for r in res["rows"]:
            print(f"{r['config']:<14} {r['dtype']:<5} {r['params'] / 1e6:>7.1f}M {r['active_params'] / 1e6:>7.1f}M "
                  f"{r['step_s_median']:>8.4f} {r['step_s_min']:>8.4f} {r['tokens_per_s']:>10.0f} "
                  f"{r['achieved_flops'] / 1e9:>9.1f} {res['peak_flops'] / 1e9:>9.1f} {r['mfu']:>6.1%} "
                  f"{r['mfu_best_step']:>6.1%}")
    for res in results:
        print(f"matmul peak ({res['dtype']}, {args.peak_size}^3, best of 10): {res['peak_flops_before'] / 1e9:.1f} "
              f"GFLOP/s before, {res['peak_flops_after'] / 1e9:.1f} after the steps; MFU uses the larger")
        if res["peak_flops_datasheet"]:
            print(f"  against the data-sheet peak ({res['peak_flops_datasheet'] / 1e12:.1f} TFLOP/s): MFU "
                  + ", ".join(f"{r['config']} {r['mfu_datasheet']:.1%}" for r in res["rows"]))
        if any(r["mfu"] > 1 for r in res["rows"]):
            print("  warning: MFU > 100%: the peak was measured while the host was busier than during the steps")
    for res in results:
        if "moe_over_dense" in res:
            ratio = res["moe_over_dense"]
            print(f"MoE / dense step time ({res['dtype']}): {ratio:.2f}x median, {res['moe_over_dense_min']:.2f}x best "
                  f"(target <= 1.10x){'' if ratio <= 1.10 else '  ABOVE TARGET'}")
        if args.compile:
            line = (f"compile speed-up = eager / compiled step time ({res['dtype']}; > 1: compile is faster): "
                    f"dense {res['compile_speedup_dense']:.2f}x median ({res['compile_speedup_dense_min']:.2f}x best)")
            if "compile_speedup_moe" in res:
                line += (f", MoE {res['compile_speedup_moe']:.2f}x median ({res['compile_speedup_moe_min']:.2f}x "
                         f"best); compiled MoE / dense {res['moe_over_dense_compiled']:.2f}x")
            print(line)
    path = write_json("step.json", {"args": vars(args), "environment": env, "results": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
