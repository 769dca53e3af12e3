"""Data wait: the share of step time a worker spends waiting for its Ray Data stream (target < 2%);
with --mode stream, the rate one rank's stream delivers with no model (target >= 2M tokens/s).

    python -m bench.data                      # demo corpus, demo preset model (hidden 256, 4 layers, seq 256)
    python -m bench.data --mode stream        # seq 512, micro-batch 32, on 1 and 2 CPUs

bench/README.md has the details. Writes data.json or data_stream.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from minilm import data as D
from minilm.config import ModelConfig, TrainConfig
from minilm.model import MiniMindForCausalLM
from minilm.step import make_grad_scaler, make_optimizer, optimizer_step, resolve_dtype
from ray_jobs.cli import DEMO_PRESET, ensure_ray

from .common import add_model_args, environment, write_json

TARGET = 0.02
STREAM_TARGET = 2e6  # tokens/s of one rank's stream


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.data", description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["wait", "stream"], default="wait",
                   help="wait: data wait share of a training step (default); stream: the stream's rate, no model")
    p.add_argument("--cpus", type=int, nargs="+", default=[1, 2], help="stream mode: cores of each run")
    p.add_argument("--stream-tokens", type=float, default=50e6, help="stream mode: synthetic dataset size")
    p.add_argument("--stream-steps", type=int, default=400, help="stream mode: steps of 128 sequences per run")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--data", help="prepared data dir (default: the built-in demo corpus at --seq-len)")
    add_model_args(p, ("hidden_size", "num_hidden_layers", "vocab_size", "seq_len", "micro_batch_size"),
                   **{k: DEMO_PRESET[k] for k in ("hidden_size", "num_hidden_layers", "seq_len", "micro_batch_size")})
    p.add_argument("--global-batch-size", type=int, default=DEMO_PRESET["global_batch_size"])
    p.add_argument("--steps", type=int, default=64,
                   help="optimizer steps, the first one included (the demo corpus has 61 per epoch at the defaults)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--threads", type=int, default=2, help="torch threads of the training loop")
    args = p.parse_args(argv)
    if args.child:
        return stream_child(args)
    if args.mode == "stream":
        return stream_mode(args)
    if args.steps < 3:
        p.error("--steps must be >= 3 (the first step is start-up)")
    if args.global_batch_size % args.micro_batch_size:
        p.error("--global-batch-size must be a multiple of --micro-batch-size")
    return wait_mode(args, p)


def wait_mode(args, p) -> int:
    """The default mode: the stream feeding a training loop, the wait in next_step() against the whole step."""
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
    train_ids = np.arange(prepared.num_sequences, dtype=np.int64)
    per_epoch = D.steps_per_epoch(len(train_ids), args.global_batch_size)
    if per_epoch < 1:
        p.error(f"{len(train_ids)} sequences do not fill one global batch of {args.global_batch_size}")

    device = torch.device("cpu")
    dtype = resolve_dtype(args.dtype, device)
    torch.manual_seed(0)
    model = MiniMindForCausalLM(ModelConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                                            vocab_size=args.vocab_size,
                                            max_position_embeddings=args.seq_len + 1)).train()
    optimizer = make_optimizer(model, TrainConfig(optimizer="adamw", lr=1e-4))
    scaler = make_grad_scaler(dtype, device.type)
    stream = RankStream(str(data_dir), D.RankOrder(train_ids, 42, per_epoch, args.global_batch_size, 1, 0, 0),
                        args.steps, args.micro_batch_size, device)
    records = timed_steps(stream, model, optimizer, scaler, dtype, args.steps, per_epoch)
    result = wait_figures(records)
    result = {"args": vars(args), "environment": environment(), "data_dir": str(data_dir), "dtype": str(dtype),
              "steps_per_epoch": per_epoch, **result}
    env = result["environment"]
    print(f"# {env['cpu']}, {args.threads} torch threads, torch {env['torch']}, load average {env['load_average']}")
    print(f"# data {data_dir} ({prepared.num_sequences:,} sequences: {per_epoch} steps per epoch); hidden {args.hidden_size}, layers {args.num_hidden_layers}, seq {args.seq_len}, global batch "
          f"{args.global_batch_size} of micro-batches of {args.micro_batch_size}, {str(dtype).removeprefix('torch.')}")
    print_wait(result)
    print(f"wrote {write_json('data.json', result)}")
    return 0


def timed_steps(stream, model, optimizer, scaler, dtype, steps: int, per_epoch: int) -> list[dict]:
    records = []
    for step in range(steps):
        waited_before = stream.data_wait_s
        t0 = time.perf_counter()
        micro_batches, _ = stream.next_step()
        m = optimizer_step(model, optimizer, scaler, micro_batches, lr=1e-4, grad_clip=1.0, dtype=dtype)
        float(m.loss)
        records.append({"step": step + 1, "step_s": time.perf_counter() - t0,
                        "wait_s": stream.data_wait_s - waited_before, "epoch_start": step % per_epoch == 0})
    # Drop the stream (its Ray Data iterators) while Ray is still up: finalised after Ray's exit hook,
    # they print errors about a Ray that is gone.
    del stream, micro_batches
    gc.collect()
    return records


def wait_figures(records: list[dict]) -> dict:
    """The first step (pipeline start-up) apart; the steady steps' wait share, within epochs and overall."""
    steady = records[1:]
    wait = sum(r["wait_s"] for r in steady)
    total = sum(r["step_s"] for r in steady)
    frac = wait / total
    boundaries = [r for r in steady if r["epoch_start"]]
    inside = [r for r in steady if not r["epoch_start"]]
    frac_inside = sum(r["wait_s"] for r in inside) / sum(r["step_s"] for r in inside) if inside else float("nan")
    return {
        "first_step_s": records[0]["step_s"], "first_wait_s": records[0]["wait_s"],
        "steady_steps": len(steady), "steady_step_s_median": statistics.median(r["step_s"] for r in steady),
        "steady_wait_s_total": wait, "steady_step_s_total": total, "data_wait_frac": frac,
        "data_wait_frac_within_epochs": frac_inside,
        "max_wait_s": max(r["wait_s"] for r in steady),
        "epoch_boundary_wait_s": [r["wait_s"] for r in boundaries], "records": records,
    }


def print_wait(result: dict) -> None:
    first, boundaries = result["records"][0], result["epoch_boundary_wait_s"]
    print(f"{'':<34}{'seconds':>10}")
    print(f"{'first step (pipeline start-up)':<34}{first['step_s']:>10.3f}  (wait {first['wait_s']:.3f})")
    print(f"{'steady step, median':<34}{result['steady_step_s_median']:>10.3f}")
    print(f"{'steady wait, total':<34}{result['steady_wait_s_total']:>10.3f}  over {result['steady_steps']} steps "
          f"({result['steady_step_s_total']:.1f} s)")
    print(f"{'largest wait of one step':<34}{result['max_wait_s']:>10.3f}")
    if boundaries:
        print(f"{'wait at epoch starts':<34}{max(boundaries):>10.3f}  (largest of {len(boundaries)})")
    frac = result["data_wait_frac"]
    verdict = "" if frac < TARGET else "  ABOVE TARGET"
    print(f"data wait within epochs: {100 * result['data_wait_frac_within_epochs']:.2f}% of step time")
    print(f"data wait: {100 * frac:.2f}% of step time (all steps after the first, {len(boundaries)} epoch start(s) "
          f"included; target < {100 * TARGET:.0f}%){verdict}")


# ---- --mode stream --------------------------------------------------------------------------------------

class NoRead:
    """The stream's reader without the reads: ids in, rows of zeros out (Ray Data's own cost)."""

    def __init__(self, order: D.RankOrder, row_len: int):
        self.order, self.row_len = order, row_len

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = self.order.sample_ids(batch["id"])
        return {"sample_id": ids, "input_ids": np.zeros((len(ids), self.row_len), np.int32)}


def rank_stream_rate(data_dir: str, order: D.RankOrder, steps: int, micro_batch: int, device="cpu") -> dict:
    """One rank's `RankStream` driven alone for `steps` optimizer steps after its first (the pipeline's start, not
    counted), copies to a CUDA device waited for: its start and delivery rate. The GPU check's stream part too."""
    from ray_jobs.stream import RankStream

    stream = RankStream(data_dir, order, steps + 1, micro_batch, torch.device(device))
    t0 = time.perf_counter()
    stream.next_step()
    start_s, t0, tokens, micro_batches = time.perf_counter() - t0, time.perf_counter(), 0, None
    for _ in range(steps):
        micro_batches, _ = stream.next_step()
        tokens += sum(b.shape[0] * (b.shape[1] - 1) for b in micro_batches)
    if stream.device.type == "cuda":
        torch.cuda.synchronize(stream.device)  # the last copies have landed
    seconds = time.perf_counter() - t0
    del stream, micro_batches  # its Ray Data iterators go while Ray is up
    return {"start_s": start_s, "seconds": seconds, "tokens_per_s": tokens / seconds}


def stream_child(args) -> int:
    """One measurement, in a process already pinned to its cores: prints one JSON line."""
    import ray

    spec = json.loads(args.child)
    data = D.open_prepared(spec["data"])
    m, accumulation = 32, 4
    G, seq = m * accumulation, data.seq_len
    train_ids = np.arange(data.num_sequences, dtype=np.int64)
    spe = D.steps_per_epoch(len(train_ids), G)
    steps = min(spec["steps"], spe)
    if spec["cold"]:
        from .scale import drop_page_cache

        drop_page_cache(data.shard_paths)
    ray.init(address="local", num_cpus=spec["cpus"], include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")

    def rate(next_batch) -> float:
        next_batch()  # start-up, not counted
        t0 = time.perf_counter()
        for _ in range(steps - 1):
            next_batch()
        return (steps - 1) * G * seq / (time.perf_counter() - t0)

    stream_rate = rank_stream_rate(spec["data"], D.RankOrder(train_ids, 1, spe, G, 1, 0, 0), steps - 1, m)
    stream_rate = stream_rate["tokens_per_s"]
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    noread = ray.data.range(steps * G).map_batches(
        NoRead, fn_constructor_args=(D.RankOrder(train_ids, 2, spe, G, 1, 0, 0), seq + 1), batch_size=m,
        batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0)
    noread_batches = iter(noread.iter_batches(batch_size=m, prefetch_batches=4, batch_format="numpy"))

    def noread_step():
        for _ in range(accumulation):
            torch.from_numpy(next(noread_batches)["input_ids"]).long()

    noread_rate = rate(noread_step)
    if spec["cold"]:
        drop_page_cache(data.shard_paths)
    store, position = D.SequenceStore(data), [0]
    other = D.RankOrder(train_ids, 3, spe, G, 1, 0, 0)  # an order the stream did not read: as cold as it was

    def take_step():
        ids = other.sample_ids(np.arange(position[0], position[0] + G))
        position[0] += G
        torch.from_numpy(store.take(ids)).long()

    take_rate = rate(take_step)
    ray.shutdown()
    print(json.dumps({"cpus": spec["cpus"], "cold": spec["cold"], "steps": steps, "stream_tokens_per_s": stream_rate,
                      "noread_tokens_per_s": noread_rate, "take_tokens_per_s": take_rate,
                      "load_average": list(os.getloadavg())}))
    return 0


def stream_mode(args) -> int:
    from .scale import write_synthetic

    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-data-stream-") as tmp:
        data = write_synthetic(Path(tmp) / "data", int(args.stream_tokens), 512, args.vocab_size)
        specs = [{"cpus": c, "cold": False} for c in args.cpus] + [{"cpus": max(args.cpus), "cold": True}]
        for spec in specs:
            spec.update(data=str(data.path), steps=args.stream_steps)
            cores = sorted(os.sched_getaffinity(0))[: spec["cpus"]]
            proc = subprocess.run([sys.executable, "-m", "bench.data", "--child", json.dumps(spec)],
                                  capture_output=True, text=True, timeout=900,
                                  preexec_fn=lambda cores=cores: os.sched_setaffinity(0, cores))
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    env = environment()
    print(f"# {env['cpu']}; one rank's stream, seq 512, micro-batch 32 x accumulation 4, {args.stream_tokens / 1e6:.0f}M "
          f"token synthetic dataset in random order; tokens/s (millions), one run each")
    print(f"{'cores':>5} {'page cache':>10} {'stream':>8} {'Ray Data, no reads':>19} {'take() alone':>13} {'load':>6}")
    for r in runs:
        print(f"{r['cpus']:>5} {'cold' if r['cold'] else 'warm':>10} {r['stream_tokens_per_s'] / 1e6:>8.2f} "
              f"{r['noread_tokens_per_s'] / 1e6:>19.2f} {r['take_tokens_per_s'] / 1e6:>13.2f} "
              f"{r['load_average'][0]:>6.2f}")
    worst = min(r["stream_tokens_per_s"] for r in runs if not r["cold"])
    verdict = "meets" if worst >= STREAM_TARGET else "BELOW"
    print(f"stream rate: {worst / 1e6:.2f}M tokens/s in the slowest warm-cache run ({verdict} the target of "
          f"{STREAM_TARGET / 1e6:.0f}M tokens/s per rank)")
    path = write_json("data_stream.json", {"args": vars(args), "environment": env, "runs": runs})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
