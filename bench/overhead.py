"""Ray's overhead and data-parallel scaling on one machine, each a ratio measured side by side in one run.

    python -m bench.overhead                 # demo preset (hidden 256, 4 layers, seq 256, global batch 32), fp32
    python -m bench.overhead --steps 60 --single-steps 25 --rounds 6      # longer, steadier
    python -m bench.overhead --skip-ddp      # only part 1

Part 1, Ray Train with 1 worker vs the single-process loop, same config: `minilm.train.train`
(single process), then `ray_jobs.pretrain` with 1 worker (`--cpus-per-worker` = --threads), then the
single-process loop again. The Ray figure is the mean `tokens_per_s` of its steady log intervals
(the first interval and intervals that hold a checkpoint excluded), compared with the faster
single-process run (background load only slows a run down, so that is the conservative
reference). It also reports the data wait and the checkpoint cost from the job's metrics.

Part 2, 2 workers on 2 CPUs (1 thread each, DDP over gloo, set up by Ray Train's TorchTrainer):
each round runs, one after the other, the same global batch as

  1. one worker alone (rank 0, 1 thread; rank 1 waits): the reference for scaling;
  2. two DDP workers, each its half, all-reducing once per optimizer step (`no_sync` on the
     accumulation micro-steps: the library's default);
  3. two DDP workers without `no_sync` (an all-reduce after every micro-step);
  4. two DDP workers whose all-reduce is replaced by a no-op (comm hook): the compute alone.

Scaling efficiency = tokens/s of (2) / (2 x tokens/s of (1)). All-reduce share of step time =
1 - time(4) / time(2), and the same against (3). Rounds alternate the four, so background load
hits them alike. Prints a table and writes overhead.json to bench/results/ (or $MINILM_BENCH_RESULTS).
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

from .common import environment, write_json

# ---- part 1: Ray Train (1 worker) vs the single-process loop ----------------------------------------

def single_process_tokens_per_s(model_cfg, train_cfg, sequences, warmup: int) -> float:
    _, history = train(model_cfg, train_cfg, sequences, log=lambda s: None)
    times = [h["step_time_s"] for h in history[warmup:]]
    return train_cfg.global_batch_size * train_cfg.seq_len / statistics.mean(times)


def job_checkpoint_every(args) -> int:
    """The job checkpoints at least once before its last step: the metrics carry a checkpoint's wall time
    in the next log record, so one mid-run checkpoint is what gives the checkpoint cost."""
    return min(args.checkpoint_every, max(1, args.steps // 2))


def steady_records(records: list[dict], every: int) -> list[dict]:
    """Log intervals without start-up and without a checkpoint: not the first record, and not a record
    right after a checkpoint step (the save happens after that step's metrics, in the next interval)."""
    return [r for prev, r in zip(records[:-1], records[1:], strict=True) if prev["optimizer_step"] % every != 0]


def ray_job(data_dir: Path, args, storage: Path) -> list[dict]:
    from ray_jobs import pretrain

    argv = ["--data", str(data_dir), "--num-workers", "1", "--cpus-per-worker", str(args.threads),
            "--dtype", args.dtype, "--max-steps", str(args.steps), "--warmup-steps", str(min(5, args.steps - 1)),
            "--log-every", str(args.log_every), "--checkpoint-every", str(job_checkpoint_every(args)),
            "--storage-path", str(storage), "--name", "overhead",
            "--hidden-size", str(args.hidden_size), "--num-hidden-layers", str(args.num_hidden_layers),
            "--vocab-size", str(args.vocab_size), "--seq-len", str(args.seq_len),
            "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(args.global_batch_size)]
    code = pretrain.main(argv)
    if code != 0:
        raise SystemExit(f"the Ray job failed (exit {code})")
    return [json.loads(line) for line in (storage / "overhead" / "metrics.jsonl").read_text().splitlines()]


def ray_vs_single(args, model_cfg: ModelConfig, train_cfg: TrainConfig) -> dict:
    from ray_jobs.demo_data import demo_data_dir

    data_dir = Path(args.data) if args.data else demo_data_dir(train_cfg.seq_len, model_cfg.vocab_size)
    prepared = D.open_prepared(data_dir)
    sequences = torch.as_tensor(D.SequenceStore(prepared).take(np.arange(prepared.num_sequences))).long()
    warmup = min(3, args.single_steps - 1)
    torch.set_num_threads(args.threads)
    single_a = single_process_tokens_per_s(model_cfg, train_cfg, sequences, warmup=warmup)
    with tempfile.TemporaryDirectory() as tmp:
        records = ray_job(data_dir, args, Path(tmp))
    single_b = single_process_tokens_per_s(model_cfg, train_cfg, sequences, warmup=warmup)

    steady = steady_records(records, job_checkpoint_every(args))
    if not steady:
        raise SystemExit(f"no steady log interval: raise --steps ({args.steps}) to a few --log-every ({args.log_every})")
    ray_tps = statistics.mean(r["tokens_per_s"] for r in steady)
    single = max(single_a, single_b)
    checkpoint_s = statistics.mean(r["checkpoint_s"] for r in records if r["checkpoint_s"] > 0)
    # One checkpoint against checkpoint_every steady steps: the share at the demo's interval, whatever
    # interval this short job used to get a checkpoint measured.
    step_s = train_cfg.global_batch_size * train_cfg.seq_len / ray_tps
    return {"single_tokens_per_s": [single_a, single_b], "ray_tokens_per_s": ray_tps, "ray_over_single": ray_tps / single,
            "overhead": 1 - ray_tps / single, "checkpoint_s": checkpoint_s, "checkpoint_every": args.checkpoint_every,
            "checkpoint_fraction": checkpoint_s / (checkpoint_s + args.checkpoint_every * step_s),
            "data_wait_frac": statistics.mean(r["data_wait_frac"] for r in steady), "steady_intervals": len(steady)}


# ---- part 2: 2 DDP workers on 2 CPUs ----------------------------------------------------------------

def ddp_rounds(config: dict) -> None:
    """Ray Train worker function of part 2 (both ranks); reports rank 0's step times per variant."""
    import ray.train
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from minilm.model import MiniMindForCausalLM
    from minilm.step import make_grad_scaler, make_optimizer, optimizer_step

    torch.set_num_threads(1)  # 1 CPU per worker
    rank, world = dist.get_rank(), dist.get_world_size()
    model_cfg, cfg = ModelConfig.from_dict(config["model"]), TrainConfig.from_dict(config["train"])
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[config["dtype"]]
    scaler = make_grad_scaler(dtype, "cpu")

    def fresh():
        torch.manual_seed(cfg.seed)  # identical weights on both ranks, as the job does
        model = MiniMindForCausalLM(model_cfg).train()
        return model, make_optimizer(model, cfg)

    def local_only(_state, bucket):  # the comm hook of variant 4: gradients stay as they are
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    single, single_opt = fresh()
    synced, synced_opt = fresh()
    synced = DDP(synced)
    compute, compute_opt = fresh()
    compute = DDP(compute)
    compute.register_comm_hook(None, local_only)

    gen = torch.Generator().manual_seed(1)  # the same batches on both ranks; each takes its slice
    G, m = cfg.global_batch_size, cfg.micro_batch_size
    batches = [torch.randint(0, model_cfg.vocab_size, (G, cfg.seq_len + 1), generator=gen)
               for _ in range(config["rounds"] + config["warmup"])]

    def timed(fn, *args, **kwargs) -> float:
        dist.barrier()  # both ranks start together; the wait for the other rank is not timed
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        elapsed = time.perf_counter() - t0
        dist.barrier()
        return elapsed

    def step(model, optimizer, micro_batches, no_sync: bool = True) -> None:
        m = optimizer_step(model, optimizer, scaler, micro_batches, lr=1e-4, grad_clip=1.0, dtype=dtype,
                           no_sync=no_sync)
        float(m.loss)

    def alone(micro_batches) -> None:  # rank 0 does the whole batch; rank 1 only meets it at the barriers
        if rank == 0:
            step(single, single_opt, micro_batches)

    times = {"single": [], "ddp_no_sync": [], "ddp_sync_every_micro_step": [], "ddp_no_allreduce": []}
    for i, batch in enumerate(batches):
        mine = list(batch.chunk(world)[rank].split(m))
        round_times = {
            "single": timed(alone, list(batch.split(m))),
            "ddp_no_sync": timed(step, synced, synced_opt, mine),
            "ddp_sync_every_micro_step": timed(step, synced, synced_opt, mine, no_sync=False),
            "ddp_no_allreduce": timed(step, compute, compute_opt, mine),
        }
        if i >= config["warmup"]:
            for k, v in round_times.items():
                times[k].append(v)
    metrics = {"times": times, "rank": rank, "accumulation": len(mine), "world_size": world}
    # Ray Train v2 hands the driver only metrics that come with a checkpoint: rank 0 attaches a tiny one.
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if rank == 0:
            Path(tmp, "times.json").write_text(json.dumps(times))
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report(metrics, checkpoint=checkpoint)


def two_workers(args, model_cfg: ModelConfig, train_cfg: TrainConfig) -> dict:
    from ray.train import LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    config = {"model": model_cfg.to_dict(), "train": train_cfg.to_dict(), "dtype": args.dtype,
              "rounds": args.rounds, "warmup": 1}
    with tempfile.TemporaryDirectory() as tmp:
        trainer = TorchTrainer(ddp_rounds, train_loop_config=config,
                               scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                                            resources_per_worker={"CPU": 1}),
                               run_config=RunConfig(name="overhead-ddp", storage_path=tmp,
                                                    logging_config=LoggingConfig(log_level="WARNING")),
                               torch_config=TorchConfig(backend="gloo"))
        result = trainer.fit()
    times = result.metrics["times"]
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = train_cfg.global_batch_size * train_cfg.seq_len
    return {"step_s_median": med, "step_s_all": times, "tokens_per_s": {k: tokens / v for k, v in med.items()},
            "accumulation_per_rank": result.metrics["accumulation"],
            "scaling_efficiency": med["single"] / (2 * med["ddp_no_sync"]),
            "scaling_efficiency_without_no_sync": med["single"] / (2 * med["ddp_sync_every_micro_step"]),
            "allreduce_share": 1 - med["ddp_no_allreduce"] / med["ddp_no_sync"],
            "allreduce_share_without_no_sync": 1 - med["ddp_no_allreduce"] / med["ddp_sync_every_micro_step"],
            "no_sync_speedup": med["ddp_sync_every_micro_step"] / med["ddp_no_sync"]}


# ---- main -----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps of the Ray job (part 1)")
    p.add_argument("--single-steps", type=int, default=8, help="optimizer steps of each single-process run (part 1)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of part 2 (after one warm-up round)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--threads", type=int, default=2, help="torch threads (single) = CPUs per worker (Ray), part 1")
    p.add_argument("--log-every", type=int, default=4)
    p.add_argument("--checkpoint-every", type=int, default=DEMO_PRESET["checkpoint_every"])
    p.add_argument("--data", help="prepared data dir for part 1 (default: the built-in demo corpus)")
    for name in ("hidden_size", "num_hidden_layers", "seq_len", "micro_batch_size", "global_batch_size"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=DEMO_PRESET[name])
    p.add_argument("--vocab-size", type=int, default=6400)
    p.add_argument("--skip-ray-vs-single", action="store_true", help="only part 2")
    p.add_argument("--skip-ddp", action="store_true", help="only part 1")
    args = p.parse_args(argv)
    if args.single_steps < 2 or args.rounds < 1:
        p.error("--single-steps must be >= 2 and --rounds >= 1")
    if args.global_batch_size % (2 * args.micro_batch_size):
        p.error("--global-batch-size must be a multiple of 2 x --micro-batch-size (part 2 has 2 workers)")

    ensure_ray()
    preset = {**DEMO_PRESET, **{k: getattr(args, k) for k in ("hidden_size", "num_hidden_layers", "seq_len",
                                                              "micro_batch_size", "global_batch_size")}}
    model_cfg = ModelConfig(**{k: v for k, v in preset.items() if k in ModelConfig.__dataclass_fields__},
                            vocab_size=args.vocab_size)
    train_cfg = TrainConfig(**{k: v for k, v in preset.items() if k in TrainConfig.__dataclass_fields__})
    train_cfg.dtype, train_cfg.warmup_steps, train_cfg.max_steps = args.dtype, 1, args.single_steps
    t_start = time.perf_counter()
    part1 = None if args.skip_ray_vs_single else ray_vs_single(args, model_cfg, train_cfg)
    part2 = None if args.skip_ddp else two_workers(args, model_cfg, train_cfg)
    env = environment()

    print(f"\n# {env['cpu']}, {env['cpus']} CPUs, torch {env['torch']}, load average {env['load_average']}")
    print(f"# config: hidden {model_cfg.hidden_size}, {model_cfg.num_hidden_layers} layers, seq {train_cfg.seq_len}, "
          f"global batch {train_cfg.global_batch_size} of micro-batches of {train_cfg.micro_batch_size}, {args.dtype}")
    if part1:
        single_a, single_b = part1["single_tokens_per_s"]
        print(f"{'part 1: run':<44}{'tokens/s':>12}")
        print(f"{'single process (before), ' + str(args.threads) + ' threads':<44}{single_a:>12,.0f}")
        print(f"{'Ray Train, 1 worker x ' + str(args.threads) + ' CPUs':<44}{part1['ray_tokens_per_s']:>12,.0f}")
        print(f"{'single process (after)':<44}{single_b:>12,.0f}")
        print(f"Ray / single: {part1['ray_over_single']:.3f}  (overhead {100 * part1['overhead']:+.1f}%, target < 3%)")
        print(f"data wait: {100 * part1['data_wait_frac']:.2f}% of step time (target < 2%)")
        print(f"checkpoint: {part1['checkpoint_s']:.2f} s every {args.checkpoint_every} steps = "
              f"{100 * part1['checkpoint_fraction']:.2f}% of training time")
    if part2:
        med, tps = part2["step_s_median"], part2["tokens_per_s"]
        labels = {"single": "1 worker x 1 CPU (whole batch)",
                  "ddp_no_sync": "2 workers x 1 CPU, no_sync (default)",
                  "ddp_sync_every_micro_step": "2 workers x 1 CPU, all-reduce every micro-step",
                  "ddp_no_allreduce": "2 workers x 1 CPU, no all-reduce (compute)"}
        print(f"{'part 2: ' + str(args.rounds) + ' rounds, median':<50}{'step s':>8}{'tokens/s':>10}")
        for k, label in labels.items():
            print(f"{label:<50}{med[k]:>8.3f}{tps[k]:>10,.0f}")
        print(f"scaling efficiency, 2 workers vs 1 (1 CPU each): {part2['scaling_efficiency']:.1%} with no_sync, "
              f"{part2['scaling_efficiency_without_no_sync']:.1%} without")
        print(f"all-reduce share of step time: {part2['allreduce_share']:.1%} with no_sync, "
              f"{part2['allreduce_share_without_no_sync']:.1%} without ({part2['accumulation_per_rank']} micro-steps "
              f"per rank); no_sync makes the step {part2['no_sync_speedup']:.2f}x faster")
        if part1:
            print(f"2 workers x 1 CPU / 1 Ray worker x {args.threads} CPUs: "
                  f"{tps['ddp_no_sync'] / part1['ray_tokens_per_s']:.2f}x tokens/s")
    wall = time.perf_counter() - t_start
    print(f"wall time {wall:.0f} s")
    path = write_json("overhead.json", {"args": vars(args), "environment": env, "ray_vs_single": part1,
                                        "two_workers": part2, "wall_s": wall})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
