"""The Ray loop's fixed per-step cost (part 1: a bare `optimizer_step` loop, `python -m minilm.train` and the
1-worker Ray job, fresh processes, rounds alternating) and how long ray.train.report blocks (part 3).
bench/README.md has the details. Writes overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from minilm import data as D
from minilm.config import ModelConfig, TrainConfig
from minilm.model import MiniMindForCausalLM
from minilm.step import make_grad_scaler, make_optimizer, optimizer_step, resolve_dtype
from ray_jobs.cli import DEMO_PRESET, ensure_ray

from .common import add_model_args, environment, machine, read_metrics, steady_step_s, table, write_json

# Issue #17's tiny config: steps of a few ms, so a fixed cost per step shows.
FIXED_COST_PRESET = {"hidden_size": 64, "num_hidden_layers": 2, "seq_len": 128, "micro_batch_size": 8,
                     "global_batch_size": 8}
REFERENCE_STEP_S = 0.020  # a MiniMind-26M optimizer step on one H100: what the fixed cost is weighed against
REPORT_INTERVALS_S = (0.05, 0.2, 0.5, 1.0, 2.0, 3.0)
RUNS = {"bare": "(a) bare optimizer_step loop", "trainer": "(b) Trainer in-process (minilm.train)",
        "ray": "(c) Ray job, 1 worker, default flags"}


# ---- part 1: the fixed per-step cost of the loop -----------------------------------------------------

def bare_loop(config: dict) -> None:
    """(a), run as `python -c`: `optimizer_step` alone on global batches read from the prepared data up front;
    prints seconds per step, over the steps after the first log interval, as JSON."""
    model_cfg, train_cfg = ModelConfig.from_dict(config["model"]), TrainConfig.from_dict(config["train"])
    prepared, G = D.open_prepared(config["data"]), train_cfg.global_batch_size
    warmup, steps = train_cfg.log_every, train_cfg.max_steps - train_cfg.log_every
    rows = torch.as_tensor(D.SequenceStore(prepared).take(np.arange(G * (warmup + steps)) % prepared.num_sequences))
    torch.manual_seed(train_cfg.seed)
    model = MiniMindForCausalLM(model_cfg).train()
    optimizer, dtype = make_optimizer(model, train_cfg), resolve_dtype(train_cfg.dtype, "cpu")
    scaler = make_grad_scaler(dtype, "cpu")
    for i, batch in enumerate(rows.long().split(G)):
        if i == warmup:
            t0 = time.perf_counter()
        m = optimizer_step(model, optimizer, scaler, list(batch.split(train_cfg.micro_batch_size)), lr=train_cfg.lr,
                           grad_clip=train_cfg.grad_clip, dtype=dtype)
    float(m.loss)
    print(json.dumps({"step_s": (time.perf_counter() - t0) / steps}))


def one_run(kind: str, data_dir: Path, model_cfg: ModelConfig, train_cfg: TrainConfig, env: dict) -> dict:
    """(a) the bare loop, (b) `python -m minilm.train` (the Trainer in one process, no Ray) or (c) `python -m
    ray_jobs.pretrain --num-workers 1`, other run flags at their defaults, in a fresh process; (b) and (c) timed by
    the wall time between their metrics records (`steady_step_s`)."""
    config = {"model": model_cfg.to_dict(), "train": train_cfg.to_dict(), "data": str(data_dir)}
    flags = [f"--{k.replace('_', '-')}={config[part][k]}" for part, keys in (
        ("model", ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")),
        ("train", ("seq_len", "micro_batch_size", "global_batch_size", "dtype", "max_steps", "warmup_steps", "lr",
                   "log_every", "checkpoint_every"))) for k in keys]
    with tempfile.TemporaryDirectory() as tmp:
        argv = {"bare": ["-c", "import json, sys; from bench.overhead import bare_loop; bare_loop(json.loads(sys.argv[1]))",
                         json.dumps(config)],
                "trainer": ["-m", "minilm.train", "--data", str(data_dir), "--run-dir", f"{tmp}/run", *flags],
                "ray": ["-m", "ray_jobs.pretrain", "--num-workers", "1", "--data", str(data_dir), "--run-dir",
                        f"{tmp}/run", *flags]}[kind]
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"run {kind} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        if kind == "bare":
            return json.loads(proc.stdout.splitlines()[-1])
        records = read_metrics(Path(tmp) / "run" / "metrics.jsonl")
    step_s, counted = steady_step_s(records, train_cfg.checkpoint_every)
    checkpoints = [r["checkpoint_s"] for r in records if r.get("checkpoint_s", 0) > 0]
    cpus = re.search(r"workers 1 x (\S+) CPU", proc.stdout)
    waits = [r["data_wait_frac"] for p, r in zip(records[:-1], records[1:], strict=True)
             if p["optimizer_step"] % train_cfg.checkpoint_every]
    return {"step_s": step_s, "steps_counted": counted, "cpus_per_worker": cpus.group(1) if cpus else None,
            "checkpoint_s": statistics.mean(checkpoints) if checkpoints else None,
            "data_wait_frac": statistics.mean(waits) if kind == "ray" and waits else None}


def fixed_cost(args, model_cfg: ModelConfig, train_cfg: TrainConfig) -> dict:
    from ray_jobs.demo_data import demo_data_dir

    data_dir = Path(args.data) if args.data else demo_data_dir(train_cfg.seq_len, model_cfg.vocab_size)
    D.check_compatible(D.open_prepared(data_dir), vocab_size=model_cfg.vocab_size, seq_len=train_cfg.seq_len)
    # Every run is a fresh process in the same environment (the Ray job's worker inherits it through the local Ray
    # its driver starts). The job's worker threads come from --cpus-per-worker (auto: the cores); (a) and (b) get
    # --threads (default: the cores) through OMP_NUM_THREADS, which the job's other Ray processes must not see.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    threads = {**env, "OMP_NUM_THREADS": str(args.threads)}
    envs = {"bare": threads, "trainer": threads, "ray": env}
    runs: dict[str, list[dict]] = {name: [] for name in envs}
    loads = []
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name, run_env in envs.items():
            runs[name].append(one_run(name, data_dir, model_cfg, train_cfg, run_env))
        print(f"round {r + 1}/{args.rounds} (load {loads[-1]}): " + ", ".join(
            f"{k} {1e3 * v[-1]['step_s']:.2f} ms" for k, v in runs.items()), flush=True)
    median = {k: statistics.median(x["step_s"] for x in v) for k, v in runs.items()}
    loops, ray = [k for k in runs if k != "bare"], runs["ray"]
    cost = {k: median[k] - median["bare"] for k in loops}
    checkpoints = [x["checkpoint_s"] for x in ray if x["checkpoint_s"] is not None]
    waits = [x["data_wait_frac"] for x in ray if x["data_wait_frac"] is not None]
    return {"data": str(data_dir), "rounds": runs, "step_s_median": median,
            "step_s_range": {k: (min(x["step_s"] for x in v), max(x["step_s"] for x in v)) for k, v in runs.items()},
            "fixed_cost_s": cost, "fixed_cost_of_20ms_step": {k: v / REFERENCE_STEP_S for k, v in cost.items()},
            # paired per round as well: background load that drifts between rounds then cancels out
            "fixed_cost_paired_s": {k: statistics.median(x["step_s"] - b["step_s"] for x, b in
                                                         zip(runs[k], runs["bare"], strict=True)) for k in loops},
            "ray_over_trainer_tokens_per_s": median["trainer"] / median["ray"],
            "ray_over_bare_tokens_per_s": median["bare"] / median["ray"],
            "cpus_per_worker": ray[0]["cpus_per_worker"], "load_average": loads,
            "checkpoint_s": statistics.mean(checkpoints) if checkpoints else None,
            "data_wait_frac": statistics.median(waits) if waits else None}


def print_fixed_cost(part1: dict, model_cfg: ModelConfig, train_cfg: TrainConfig, args) -> None:
    med, lo_hi, tokens = part1["step_s_median"], part1["step_s_range"], train_cfg.global_batch_size * train_cfg.seq_len
    print(f"part 1: fixed per-step cost; hidden {model_cfg.hidden_size}, {model_cfg.num_hidden_layers} layers, seq "
          f"{train_cfg.seq_len}, global batch {train_cfg.global_batch_size} (micro-batch {train_cfg.micro_batch_size}), "
          f"{train_cfg.dtype}, {args.threads} threads / Ray worker x {part1['cpus_per_worker']} CPUs; "
          f"{args.rounds} rounds of {args.steps} steps")
    print(table(["run", "ms/step", "range", "tokens/s", "+ms/step", "of 20 ms"], [
        [RUNS[k], f"{1e3 * med[k]:.2f}", f"{1e3 * lo_hi[k][0]:.2f}-{1e3 * lo_hi[k][1]:.2f}",
         f"{tokens / med[k]:,.0f}", *(["", ""] if k == "bare" else [f"{1e3 * part1['fixed_cost_s'][k]:.2f}",
                                                                    f"{part1['fixed_cost_of_20ms_step'][k]:.1%}"])]
        for k in med]))
    print("fixed cost per step over (a), paired by round: " + ", ".join(
        f"({'bc'[i]}) {1e3 * v:+.2f} ms" for i, v in enumerate(part1["fixed_cost_paired_s"].values()))
          + f" (target: < 5% of a 20 ms step = 1 ms)\nRay job / Trainer in-process: "
          f"{part1['ray_over_trainer_tokens_per_s']:.3f}x tokens/s; Ray job / bare loop: "
          f"{part1['ray_over_bare_tokens_per_s']:.3f}x")
    if part1["data_wait_frac"] is not None:
        print(f"Ray job data wait: {part1['data_wait_frac']:.2%} of step time")
    if part1["checkpoint_s"] is not None:
        every = DEMO_PRESET["checkpoint_every"]
        share = part1["checkpoint_s"] / (part1["checkpoint_s"] + every * med["ray"])
        print(f"Ray job checkpoint: {part1['checkpoint_s']:.2f} s = {share:.2%} of training time at checkpoint_every "
              f"{every}")


# ---- part 3: how long ray.train.report blocks, against the time between reports ---------------------------

def report_rounds(config: dict) -> None:
    """The worker: sleep for a log interval, then time `ray.train.report` of a metrics dict the size of the loop's; the
    times go back to the driver in a checkpoint (Ray Train v2 hands it only metrics that come with one)."""
    import ray.train

    metrics = dict.fromkeys(("loss", "lm_loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "samples_seen",
                             "tokens_seen", "eta_s", "data_wait_frac", "checkpoint_s"), 1.0)
    times: dict[str, list[float]] = {}
    for interval in config["intervals"]:
        times[str(interval)] = []
        for i in range(config["reports"]):
            time.sleep(interval)
            t0 = time.perf_counter()
            ray.train.report({**metrics, "optimizer_step": i})
            times[str(interval)].append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "times.json").write_text(json.dumps(times))
        ray.train.report({"done": 1}, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def report_blocking(args) -> dict:
    """Ray Train's controller polling at Ray's default (2 s), then at the job's (or --ray-poll-interval)."""
    from ray.train import LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from ray_jobs.pretrain import CONTROLLER_POLL_ENV, CONTROLLER_POLL_S

    results = {}
    for label, poll in {"ray_default": "2", "minilm": str(args.ray_poll_interval or CONTROLLER_POLL_S)}.items():
        with mock.patch.dict(os.environ, {CONTROLLER_POLL_ENV: poll}), tempfile.TemporaryDirectory() as tmp:
            result = TorchTrainer(  # the poll interval goes from this process to the controller at fit()
                report_rounds, train_loop_config={"intervals": list(args.report_intervals), "reports": args.reports},
                scaling_config=ScalingConfig(num_workers=1, use_gpu=False, resources_per_worker={"CPU": 1}),
                run_config=RunConfig(name="overhead-report", storage_path=tmp,
                                     logging_config=LoggingConfig(log_level="WARNING")),
                torch_config=TorchConfig(backend="gloo")).fit()
            times = json.loads(Path(result.checkpoint.path, "times.json").read_text())
        blocked = {interval: statistics.median(t[1:]) for interval, t in times.items()}  # the first follows
        results[label] = {"poll_s": float(poll), "rows": [  # another interval's reports
            {"interval_s": float(i), "report_s_median": blocked[i], "report_s_all": times[i],
             "throughput_factor": float(i) / (float(i) + blocked[i])} for i in times]}
    return results


def print_report_blocking(part3: dict) -> None:
    default, ours = part3["ray_default"], part3["minilm"]
    print(f"part 3: ray.train.report after each log interval, 1 worker; Ray Train's controller polling every "
          f"{default['poll_s']:g} s (Ray's default) and every {ours['poll_s']:g} s (the job's), one after the other")
    print(table(["interval s", "report s", "steps get", "report s", "steps get", "ratio"], [
        [f"{a['interval_s']:.2f}", f"{a['report_s_median']:.3f}", f"{a['throughput_factor']:.1%}",
         f"{b['report_s_median']:.3f}", f"{b['throughput_factor']:.1%}",
         f"{b['throughput_factor'] / a['throughput_factor']:.2f}x"]
        for a, b in zip(default["rows"], ours["rows"], strict=True)], left=0))
    print("steps get = interval / (interval + report): the share of wall time left to training when the loop reports "
          "that often; ratio: the job's setting over Ray's default")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__)
    p.add_argument("--mode", choices=["all", "fixed-cost", "report"], default="all",
                   help="fixed-cost: part 1; report: part 3; all: both")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps of each part-1 run")
    p.add_argument("--rounds", type=int, default=3, help="rounds of part 1")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="torch threads of runs (a) and (b); default the cores, as the job's --cpus-per-worker auto")
    p.add_argument("--log-every", type=int, default=TrainConfig.log_every)
    p.add_argument("--checkpoint-every", type=int, help="default: half the steps, so one checkpoint is timed mid-run")
    p.add_argument("--ray-poll-interval", type=float, help="part 3: the interval compared with Ray's default "
                   "(RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s; default: the job's, 0.1 s)")
    p.add_argument("--data", help="prepared data dir for part 1 (default: the built-in demo corpus)")
    add_model_args(p, (*FIXED_COST_PRESET, "vocab_size"), **FIXED_COST_PRESET)
    p.add_argument("--reports", type=int, default=4, help="part 3: reports timed per interval (the first is not counted)")
    p.add_argument("--report-intervals", type=lambda t: tuple(map(float, t.split(","))), default=REPORT_INTERVALS_S,
                   help="part 3: seconds between reports, comma-separated")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.log_every < 1 or args.steps < 3 * args.log_every or min(args.report_intervals) <= 0:
        p.error("--rounds and --log-every must be >= 1, --steps >= 3 x --log-every (steady log intervals), and every "
                "--report-intervals > 0")
    t_start, env = time.perf_counter(), environment()
    print(machine(env))
    part1 = part3 = None
    if args.mode in ("all", "fixed-cost"):
        model_cfg = ModelConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                                vocab_size=args.vocab_size)
        # one checkpoint about halfway, on a log step, with a steady interval before it
        every = args.checkpoint_every or max(2 * args.log_every, args.steps // 2 // args.log_every * args.log_every)
        train_cfg = TrainConfig(seq_len=args.seq_len, micro_batch_size=args.micro_batch_size, dtype=args.dtype,
                                global_batch_size=args.global_batch_size, lr=DEMO_PRESET["lr"], max_steps=args.steps,
                                warmup_steps=1, log_every=args.log_every, checkpoint_every=every)
        part1 = fixed_cost(args, model_cfg, train_cfg)
        part1["config"] = {"model": model_cfg.to_dict(), "train": train_cfg.to_dict()}
        print_fixed_cost(part1, model_cfg, train_cfg, args)
    if args.mode in ("all", "report"):
        ensure_ray()  # after part 1: its runs must not share the CPUs with an idle Ray
        part3 = report_blocking(args)
        print_report_blocking(part3)
    wall = time.perf_counter() - t_start
    print(f"wall time {wall:.0f} s")
    write_json("overhead.json", {"args": vars(args), "environment": env, "fixed_cost": part1,
                                 "report_blocking": part3, "wall_s": wall})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
