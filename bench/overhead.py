"""Ray's overhead: the Ray Train job with 1 worker vs the single-process loop, same config, one run.

    python -m bench.overhead                 # demo preset (hidden 256, 4 layers, seq 256, global batch 32), fp32
    python -m bench.overhead --steps 80 --dtype bf16

Order: single-process, Ray job, single-process again; the Ray figure is compared with the faster
of the two single-process runs (background load only ever slows a run down, so that is the
conservative reference). Steady state: warm-up steps and log
intervals that contain a checkpoint are excluded. Also reports checkpoint save time as a fraction
of training time at the checkpoint interval. Prints a table and writes bench/results/overhead.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from minilm import data as D
from minilm.config import ModelConfig, TrainConfig
from minilm.train import train
from ray_jobs.cli import DEMO_PRESET, ensure_ray

RESULTS = Path(__file__).parent / "results"


def single_process_tokens_per_s(model_cfg, train_cfg, sequences, warmup: int) -> float:
    _, history = train(model_cfg, train_cfg, sequences, log=lambda s: None)
    times = [h["step_time_s"] for h in history[warmup:]]
    return train_cfg.global_batch_size * train_cfg.seq_len / statistics.mean(times)


def ray_job(data_dir: Path, args, storage: Path) -> list[dict]:
    from ray_jobs import pretrain

    argv = ["--data", str(data_dir), "--num-workers", "1", "--cpus-per-worker", str(args.threads),
            "--dtype", args.dtype, "--max-steps", str(args.steps), "--warmup-steps", "5",
            "--log-every", str(args.log_every), "--checkpoint-every", str(args.checkpoint_every),
            "--storage-path", str(storage), "--name", "overhead"]
    code = pretrain.main(argv)
    if code != 0:
        raise SystemExit(f"the Ray job failed (exit {code})")
    return [json.loads(line) for line in (storage / "overhead" / "metrics.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60, help="optimizer steps of the Ray job")
    p.add_argument("--single-steps", type=int, default=25, help="optimizer steps of each single-process run")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--threads", type=int, default=2, help="torch threads (single) = CPUs per worker (Ray)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--checkpoint-every", type=int, default=DEMO_PRESET["checkpoint_every"])
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    ensure_ray()
    from ray_jobs.demo_data import demo_data_dir

    model_cfg = ModelConfig(**{k: v for k, v in DEMO_PRESET.items() if k in ModelConfig.__dataclass_fields__})
    train_cfg = TrainConfig(**{k: v for k, v in DEMO_PRESET.items() if k in TrainConfig.__dataclass_fields__})
    train_cfg.dtype, train_cfg.warmup_steps, train_cfg.max_steps = args.dtype, 5, args.single_steps
    data_dir = demo_data_dir(train_cfg.seq_len, model_cfg.vocab_size)
    prepared = D.open_prepared(data_dir)
    sequences = torch.as_tensor(D.SequenceStore(prepared).take(np.arange(prepared.num_sequences))).long()

    single_a = single_process_tokens_per_s(model_cfg, train_cfg, sequences, warmup=5)
    with tempfile.TemporaryDirectory() as tmp:
        records = ray_job(data_dir, args, Path(tmp))
    single_b = single_process_tokens_per_s(model_cfg, train_cfg, sequences, warmup=5)

    # steady state: skip the first interval (start-up) and intervals holding a checkpoint
    steady = [r for r in records[1:]
              if (r["optimizer_step"] - args.log_every) % args.checkpoint_every != 0 and r["optimizer_step"] != args.steps]
    ray_tps = statistics.mean(r["tokens_per_s"] for r in steady)
    single = max(single_a, single_b)  # conservative: the faster single-process run (load only slows a run)
    checkpoint_s = statistics.mean(r["checkpoint_s"] for r in records if r["checkpoint_s"] > 0)
    step_s = train_cfg.global_batch_size * train_cfg.seq_len / ray_tps
    checkpoint_frac = checkpoint_s / (checkpoint_s + args.checkpoint_every * step_s)
    data_wait = statistics.mean(r["data_wait_frac"] for r in steady)
    result = {"dtype": args.dtype, "threads": args.threads, "single_tokens_per_s": [single_a, single_b],
              "ray_tokens_per_s": ray_tps, "ray_over_single": ray_tps / single, "overhead": 1 - ray_tps / single,
              "checkpoint_s": checkpoint_s, "checkpoint_every": args.checkpoint_every,
              "checkpoint_fraction": checkpoint_frac, "data_wait_frac": data_wait,
              "steady_intervals": len(steady), "time": time.strftime("%Y-%m-%d %H:%M")}
    print(f"\nconfig: demo preset ({model_cfg.hidden_size} hidden, {model_cfg.num_hidden_layers} layers, seq "
          f"{train_cfg.seq_len}, global batch {train_cfg.global_batch_size}), {args.dtype}, {args.threads} threads")
    print(f"{'run':<28}{'tokens/s':>12}")
    print(f"{'single process (before)':<28}{single_a:>12,.0f}")
    print(f"{'Ray Train, 1 worker':<28}{ray_tps:>12,.0f}")
    print(f"{'single process (after)':<28}{single_b:>12,.0f}")
    print(f"Ray / single: {ray_tps / single:.3f}  (overhead {100 * (1 - ray_tps / single):+.1f}%, target < 3%)")
    print(f"data wait: {100 * data_wait:.2f}% of step time (target < 2%)")
    print(f"checkpoint: {checkpoint_s:.2f} s every {args.checkpoint_every} steps = {100 * checkpoint_frac:.1f}% "
          f"of training time")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "overhead.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
