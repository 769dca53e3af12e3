"""fp16 with the GradScaler: optimizer steps under fp16 autocast stay finite, the loss falls, and an overflow is
skipped and backs the scale off (exit 1 if one fails). Writes fp16_check.json."""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

from minilm.config import TrainConfig
from minilm.schedule import get_lr
from minilm.step import configure_backends, make_grad_scaler, optimizer_step

from .common import add_model_args, build, environment, model_config, write_json

LEARNING_DROP = 0.1  # nats; fresh rows every step, so this is learning, not noise (10-step means)
ROW_TOKENS = 512  # rows use the first 512 ids: a model soon stops predicting the others, however large its vocabulary


def counting_rows(n: int, seq_len: int, vocab_size: int, gen: torch.Generator) -> torch.Tensor:
    """(n, seq_len + 1) rows x_t = (start + stride * t) mod min(vocab, 512): learnable from the context, fresh rows
    every step (nothing to memorise)."""
    modulus = min(vocab_size, ROW_TOKENS)
    start = torch.randint(0, modulus, (n, 1), generator=gen)
    stride = torch.randint(1, 8, (n, 1), generator=gen)
    return (start + stride * torch.arange(seq_len + 1)) % modulus


def run(args) -> dict:
    device = torch.device(args.device)
    configure_backends(device)
    model, optimizer = build(model_config(args), TrainConfig(optimizer="adamw", lr=args.lr), device)
    scaler, gen = make_grad_scaler(torch.float16, device.type), torch.Generator().manual_seed(1)
    steps, scale_changes, scale, t0 = [], [], scaler.get_scale(), time.perf_counter()
    for step in range(1, args.steps + 1):
        micro_batches = [counting_rows(args.micro_batch_size, args.seq_len, args.vocab_size, gen).to(device)]
        injected = step == args.overflow_at
        before = model.lm_head.weight.detach().clone() if injected else None
        hook = model.lm_head.weight.register_hook(lambda g: g * math.inf) if injected else None
        try:
            m = optimizer_step(model, optimizer, scaler, micro_batches, dtype=torch.float16, grad_clip=1.0,
                               lr=get_lr(step - 1, args.steps, args.lr, args.warmup_steps, 0.1))
        finally:
            if hook is not None:
                hook.remove()
        record = {"step": step, "loss": float(m.loss), "grad_norm": float(m.grad_norm), "skipped": bool(m.skipped),
                  "scale": scaler.get_scale(), "injected_overflow": injected}
        if injected:
            record["weights_unchanged"] = bool(torch.equal(before, model.lm_head.weight.detach()))
        if record["scale"] != scale:
            scale_changes.append({"step": step, "from": scale, "to": record["scale"]})
            print(f"step {step}: scale {scale:g} -> {record['scale']:g}" + (" (injected overflow)" if injected else ""),
                  flush=True)
            scale = record["scale"]
        steps.append(record)
    wall = time.perf_counter() - t0
    normal = [s for s in steps if not s["injected_overflow"]]
    first, last = (statistics.mean(s["loss"] for s in normal[i]) for i in (slice(0, 10), slice(-10, None)))
    injected = steps[args.overflow_at - 1]
    drop = next((c for c in scale_changes if c["step"] == args.overflow_at), None)
    checks = {"finite": all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in normal),
              "overflow": injected["skipped"] and injected["weights_unchanged"] and drop is not None
              and drop["to"] == drop["from"] / 2,
              "learning": last < first - LEARNING_DROP}
    return {"device": str(device), "steps": steps, "scale_changes": scale_changes, "loss_first10": first,
            "loss_last10": last, "skipped_steps": sum(s["skipped"] for s in steps), "checks": checks,
            "passed": all(checks.values()), "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fp16_check", description=__doc__)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run (CPU autocast in fp16)")
    add_model_args(p, ("hidden_size", "num_hidden_layers", "vocab_size", "seq_len", "micro_batch_size", "steps",
                       "warmup_steps"), num_hidden_layers=8, seq_len=512, micro_batch_size=32, steps=50, warmup_steps=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--overflow-at", type=int, default=20, help="the step whose gradient is made infinite")
    args = p.parse_args(argv)
    if args.steps < 20 + 1 or not 1 <= args.overflow_at <= args.steps or args.warmup_steps >= args.steps:
        p.error("need --steps >= 21 (10 first and 10 last steps besides the injected one), 1 <= --overflow-at <= "
                "--steps, --warmup-steps < --steps")
    if args.device not in ("cpu", "cuda") or args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device must be cpu or cuda (a CUDA device this torch sees)")
    env = environment()
    print(f"# fp16 + GradScaler on {env.get('gpu', env['cpu']) if args.device == 'cuda' else env['cpu']}, torch "
          f"{env['torch']}: hidden {args.hidden_size}, {args.num_hidden_layers} layers, seq {args.seq_len}, "
          f"micro-batch {args.micro_batch_size}, {args.steps} steps, overflow injected at step {args.overflow_at}",
          flush=True)
    result = run(args)
    print(f"loss {result['steps'][0]['loss']:.3f} -> {result['steps'][-1]['loss']:.3f} (mean of the first 10 steps "
          f"{result['loss_first10']:.3f}, last 10 {result['loss_last10']:.3f}); {result['skipped_steps']} step(s) "
          f"skipped; {len(result['scale_changes'])} scale change(s); {result['wall_s']:.1f} s")
    labels = {"finite": "every other step finite", "overflow": "injected overflow skipped, weights unchanged, scale "
              "halved", "learning": f"loss falls (mean of the last 10 steps at least {LEARNING_DROP} below the first 10)"}
    for name, ok in result["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'}  {labels[name]}")
    write_json("fp16_check.json", {"args": vars(args), "environment": env, **result})
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
