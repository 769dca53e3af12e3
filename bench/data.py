"""Data wait: the share of step time a worker spends waiting for its Ray Data stream (target < 2%).

    python -m bench.data                      # demo corpus, demo preset model (hidden 256, 4 layers, seq 256)
    python -m bench.data --data data/tok --steps 40 --dtype fp32

One process drives `ray_jobs.stream.RankStream` exactly as a rank of the Ray job does (world size 1,
global batch 32 of micro-batches of 8, the parquet reader in a Ray Data actor, prefetching while the
step runs) and times, step by step, the wait in `next_step()` against the whole step
(`minilm.step.optimizer_step` included). The default run reads the whole demo corpus (61 steps
per epoch) for 64 steps, so it crosses one epoch boundary, which is one more position of the
rank's single pipeline; `--sequences` reads fewer rows, for shorter epochs. The
first step (pipeline start-up, once per run) is reported apart from the steady state. Joins the Ray
in RAY_ADDRESS or starts a local one. Writes data.json to bench/results/ (or $MINILM_BENCH_RESULTS).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from minilm import data as D
from minilm.config import ModelConfig, TrainConfig
from minilm.model import MiniMindForCausalLM
from minilm.step import make_grad_scaler, make_optimizer, optimizer_step, resolve_dtype
from ray_jobs.cli import DEMO_PRESET, ensure_ray

from .common import environment, write_json

TARGET = 0.02


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.data", description=__doc__.split("\n")[0])
    p.add_argument("--data", help="prepared data dir (default: the built-in demo corpus at --seq-len)")
    p.add_argument("--hidden-size", type=int, default=DEMO_PRESET["hidden_size"])
    p.add_argument("--num-hidden-layers", type=int, default=DEMO_PRESET["num_hidden_layers"])
    p.add_argument("--vocab-size", type=int, default=6400)
    p.add_argument("--seq-len", type=int, default=DEMO_PRESET["seq_len"])
    p.add_argument("--micro-batch-size", type=int, default=DEMO_PRESET["micro_batch_size"])
    p.add_argument("--global-batch-size", type=int, default=DEMO_PRESET["global_batch_size"])
    p.add_argument("--sequences", type=int, default=0,
                   help="rows the stream reads, from the first (0: all; an epoch is rows / global batch steps)")
    p.add_argument("--steps", type=int, default=64,
                   help="optimizer steps, the first one included (the demo corpus has 61 per epoch at the defaults)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--threads", type=int, default=2, help="torch threads of the training loop")
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error("--steps must be >= 3 (the first step is start-up)")
    if args.global_batch_size % args.micro_batch_size:
        p.error("--global-batch-size must be a multiple of --micro-batch-size")
    torch.set_num_threads(args.threads)

    ensure_ray()
    from ray_jobs.stream import RankStream  # imports ray

    if args.data:
        data_dir = Path(args.data)
    else:
        from ray_jobs.demo_data import demo_data_dir

        data_dir = demo_data_dir(args.seq_len, args.vocab_size)
    prepared = D.open_prepared(data_dir)
    D.check_compatible(prepared, vocab_size=args.vocab_size, seq_len=args.seq_len)
    train_ids = np.arange(min(args.sequences or prepared.num_sequences, prepared.num_sequences), dtype=np.int64)
    per_epoch = D.steps_per_epoch(len(train_ids), args.global_batch_size)
    if per_epoch < 1:
        p.error(f"{len(train_ids)} sequences do not fill one global batch of {args.global_batch_size}")

    device = torch.device("cpu")
    dtype = resolve_dtype(args.dtype, device)
    torch.manual_seed(0)
    model = MiniMindForCausalLM(ModelConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                                            vocab_size=args.vocab_size,
                                            max_position_embeddings=args.seq_len + 1)).train()
    optimizer = make_optimizer(model, TrainConfig(lr=1e-4))
    scaler = make_grad_scaler(dtype, device.type)
    stream = RankStream(data_dir=str(data_dir), train_ids=train_ids, seed=42, global_batch_size=args.global_batch_size,
                        micro_batch_size=args.micro_batch_size, world_size=1, rank=0, start_step=0,
                        total_steps=args.steps, steps_per_epoch=per_epoch, device=device)

    records = []
    for step in range(args.steps):
        waited_before = stream.data_wait_s
        t0 = time.perf_counter()
        micro_batches, _ = stream.next_step()
        m = optimizer_step(model, optimizer, scaler, micro_batches, lr=1e-4, grad_clip=1.0, dtype=dtype)
        float(m.loss)
        total = time.perf_counter() - t0
        records.append({"step": step + 1, "step_s": total, "wait_s": stream.data_wait_s - waited_before,
                        "epoch_start": step % per_epoch == 0})
    # Drop the stream (its Ray Data iterators) while Ray is still up: finalised after Ray's exit hook,
    # they print errors about a Ray that is gone.
    del stream, micro_batches
    gc.collect()
    steady = records[1:]
    wait = sum(r["wait_s"] for r in steady)
    total = sum(r["step_s"] for r in steady)
    frac = wait / total
    boundaries = [r for r in steady if r["epoch_start"]]
    inside = [r for r in steady if not r["epoch_start"]]
    frac_inside = sum(r["wait_s"] for r in inside) / sum(r["step_s"] for r in inside) if inside else float("nan")
    result = {
        "args": vars(args), "environment": environment(), "data_dir": str(data_dir), "dtype": str(dtype),
        "steps_per_epoch": per_epoch, "first_step_s": records[0]["step_s"], "first_wait_s": records[0]["wait_s"],
        "steady_steps": len(steady), "steady_step_s_median": statistics.median(r["step_s"] for r in steady),
        "steady_wait_s_total": wait, "steady_step_s_total": total, "data_wait_frac": frac,
        "data_wait_frac_within_epochs": frac_inside,
        "max_wait_s": max(r["wait_s"] for r in steady),
        "epoch_boundary_wait_s": [r["wait_s"] for r in boundaries], "records": records,
    }
    env = result["environment"]
    print(f"# {env['cpu']}, {args.threads} torch threads, torch {env['torch']}, load average {env['load_average']}")
    print(f"# data {data_dir} ({prepared.num_sequences:,} sequences, first {len(train_ids)} read: {per_epoch} steps "
          f"per epoch); hidden {args.hidden_size}, layers {args.num_hidden_layers}, seq {args.seq_len}, global batch "
          f"{args.global_batch_size} of micro-batches of {args.micro_batch_size}, {str(dtype).removeprefix('torch.')}")
    print(f"{'':<34}{'seconds':>10}")
    print(f"{'first step (pipeline start-up)':<34}{records[0]['step_s']:>10.3f}  (wait {records[0]['wait_s']:.3f})")
    print(f"{'steady step, median':<34}{result['steady_step_s_median']:>10.3f}")
    print(f"{'steady wait, total':<34}{wait:>10.3f}  over {len(steady)} steps ({total:.1f} s)")
    print(f"{'largest wait of one step':<34}{result['max_wait_s']:>10.3f}")
    if boundaries:
        print(f"{'wait at epoch starts':<34}{max(result['epoch_boundary_wait_s']):>10.3f}  (largest of "
              f"{len(boundaries)})")
    verdict = "" if frac < TARGET else "  ABOVE TARGET"
    print(f"data wait within epochs: {100 * frac_inside:.2f}% of step time")
    print(f"data wait: {100 * frac:.2f}% of step time (all steps after the first, {len(boundaries)} epoch start(s) "
          f"included; target < {100 * TARGET:.0f}%){verdict}")
    path = write_json("data.json", result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
