"""The Ray loop's fixed per-step cost, how long ray.train.report blocks, and data-parallel scaling on one machine.

    python -m bench.overhead                       # every part at its defaults
    python -m bench.overhead --mode fixed-cost     # part 1 at issue #17's tiny config (hidden 64, 2 layers, seq 128)

Part 1: a bare `optimizer_step` loop, `python -m minilm.train` and the 1-worker Ray job, fresh processes, rounds
alternating. Parts 2 (2 DDP workers) and 3 (report blocking): bench/overhead_train.py. Writes overhead.json.
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

import numpy as np
import torch

from minilm import data as D
from minilm.config import ModelConfig, TrainConfig
from minilm.model import MiniMindForCausalLM
from minilm.step import make_grad_scaler, make_optimizer, optimizer_step, resolve_dtype
from ray_jobs.cli import DEMO_PRESET, ensure_ray

from .common import Sampler, add_model_args, environment, load_average, write_json
from .overhead_train import REPORT_INTERVALS_S, print_ddp, print_report_blocking, report_blocking, two_workers

# Issue #17's tiny config: steps of a few ms, so a fixed cost per step shows.
FIXED_COST_PRESET = {"hidden_size": 64, "num_hidden_layers": 2, "seq_len": 128, "micro_batch_size": 8,
                     "global_batch_size": 8}
REFERENCE_STEP_S = 0.020  # a MiniMind-26M optimizer step on one H100: what the fixed cost is weighed against
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "seq_len", "micro_batch_size", "global_batch_size")

# ---- part 1: the fixed per-step cost of the loop -----------------------------------------------------


def bare_loop(config: dict) -> None:
    """(a), run as `python -c` by `bare_step_s`: `optimizer_step` alone on global batches read from the prepared
    data up front; prints wall and CPU seconds per step as JSON."""
    model_cfg, train_cfg = ModelConfig.from_dict(config["model"]), TrainConfig.from_dict(config["train"])
    prepared = D.open_prepared(config["data"])
    G, steps, warmup = train_cfg.global_batch_size, config["steps"], config["warmup"]
    ids = np.arange(G * (warmup + steps)) % prepared.num_sequences
    rows = torch.as_tensor(D.SequenceStore(prepared).take(ids)).long()
    batches = [list(rows[i * G:(i + 1) * G].split(train_cfg.micro_batch_size)) for i in range(warmup + steps)]
    torch.manual_seed(train_cfg.seed)
    model = MiniMindForCausalLM(model_cfg).train()
    optimizer = make_optimizer(model, train_cfg)
    dtype = resolve_dtype(train_cfg.dtype, "cpu")
    scaler = make_grad_scaler(dtype, "cpu")
    for i, micro_batches in enumerate(batches):
        if i == warmup:
            t0, cpu0 = time.perf_counter(), time.process_time()
        m = optimizer_step(model, optimizer, scaler, micro_batches, lr=train_cfg.lr, grad_clip=train_cfg.grad_clip,
                           dtype=dtype)
    float(m.loss)
    print(json.dumps({"step_s": (time.perf_counter() - t0) / steps,
                      "cpu_s_per_step": (time.process_time() - cpu0) / steps}))


def steady_step_s(records: list[dict], checkpoint_every: int) -> tuple[float, int]:
    """(wall seconds per optimizer step, steps counted) between metrics records after the first, without the
    intervals that hold a checkpoint (saved after its step's record)."""
    seconds, steps = 0.0, 0
    for prev, rec in zip(records[:-1], records[1:], strict=True):
        if prev["optimizer_step"] % checkpoint_every == 0:
            continue
        seconds += rec["time"] - prev["time"]
        steps += rec["optimizer_step"] - prev["optimizer_step"]
    if steps == 0:
        raise SystemExit("no steady log interval: raise --steps to several --log-every")
    return seconds / steps, steps


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def config_argv(model_cfg: ModelConfig, train_cfg: TrainConfig) -> list[str]:
    """The shape and schedule flags every run of part 1 shares."""
    argv = []
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        argv += ["--" + key.replace("_", "-"), str(getattr(model_cfg, key))]
    for key in ("seq_len", "micro_batch_size", "global_batch_size", "dtype", "max_steps", "warmup_steps", "lr",
                "log_every", "checkpoint_every"):
        argv += ["--" + key.replace("_", "-"), str(getattr(train_cfg, key))]
    return argv


def run_child(argv: list[str], env: dict, timeout: float, what: str) -> tuple[str, list]:
    """Run `python ARGV` to the end; its stdout and the CPU of its process tree, sampled (`tree_cpu`)."""
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    with Sampler(lambda: tree_cpu(proc.pid), 0.25) as cpu:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise SystemExit(f"{what} did not finish within --job-timeout {timeout:g} s") from None
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return stdout, cpu.samples


def bare_step_s(data_dir: Path, model_cfg: ModelConfig, train_cfg: TrainConfig, env: dict, timeout: float) -> dict:
    """(a) The bare loop in a fresh process, timed over the steps after the first log interval."""
    config = {"model": model_cfg.to_dict(), "train": train_cfg.to_dict(), "data": str(data_dir),
              "steps": train_cfg.max_steps - train_cfg.log_every, "warmup": train_cfg.log_every}
    code = "import json, sys; from bench.overhead import bare_loop; bare_loop(json.loads(sys.argv[1]))"
    stdout, _ = run_child(["-c", code, json.dumps(config)], env, timeout, "the bare loop")
    return json.loads(stdout.strip().splitlines()[-1])


def trainer_step_s(data_dir: Path, model_cfg: ModelConfig, train_cfg: TrainConfig, env: dict, timeout: float) -> dict:
    """(b) `python -m minilm.train` (the Trainer in one process, no Ray) with a run folder, as the job has."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["-m", "minilm.train", "--data", str(data_dir), "--run-dir", tmp, *config_argv(model_cfg, train_cfg)]
        run_child(argv, env, timeout, "python -m minilm.train")
        records = read_metrics(Path(tmp) / "metrics.jsonl")
    step_s, counted = steady_step_s(records, train_cfg.checkpoint_every)
    return {"step_s": step_s, "steps_counted": counted}


def tree_cpu(root: int) -> dict[int, tuple[str, float]]:
    """CPU seconds of `root` and each process under it, from /proc, by pid: (label, seconds). Every process of a
    job's own local Ray descends from its driver."""
    tick, stats = os.sysconf("SC_CLK_TCK"), {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                stats[int(d.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
            except (OSError, IndexError, ValueError):
                continue
    tree, grew = {root}, True
    while grew:
        children = {pid for pid, (ppid, _) in stats.items() if ppid in tree} - tree
        tree |= children
        grew = bool(children)
    return {pid: (process_label(pid), stats[pid][1]) for pid in tree if pid in stats}


def nearest(samples: list[tuple[float, dict]], t: float) -> dict:
    return min(samples, key=lambda s: abs(s[0] - t))[1] if samples else {}


def cpu_between(samples: list[tuple[float, dict]], t0: float, t1: float) -> dict[str, float]:
    """CPU seconds per process label used from the sample nearest t0 to the sample nearest t1."""
    first, used = nearest(samples, t0), {}
    for pid, (label, cpu) in nearest(samples, t1).items():
        used[label] = used.get(label, 0.0) + max(0.0, cpu - first.get(pid, (label, 0.0))[1])
    return used


def process_label(pid: int) -> str:
    """A short name for a process of the job: Ray's title (ray::RayTrainWorker...), else its program or module."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    if argv[0].startswith("ray::"):
        return argv[0].split()[0].split(".")[0]
    if len([a for a in argv if a]) == 1:  # a title set over the whole command line: split it again
        argv = argv[0].split()
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    if "-c" in argv[:-1]:  # e.g. the dashboard's module processes: "from multiprocessing.forkserver import main; ..."
        code = argv[argv.index("-c") + 1].split()
        return code[1] if code[:1] == ["from"] and len(code) > 1 else "python -c"
    script = next((a for a in argv[1:] if a.endswith(".py")), argv[0])
    return Path(script).name


def ray_job_step_s(data_dir: Path, model_cfg: ModelConfig, train_cfg: TrainConfig, env: dict, timeout: float) -> dict:
    """(c) `python -m ray_jobs.pretrain --num-workers 1`, other run flags at their defaults: what a user runs.
    Also the CPU its processes used over the steady steps."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["-m", "ray_jobs.pretrain", "--data", str(data_dir), "--num-workers", "1", "--storage-path", tmp,
                "--name", "overhead", *config_argv(model_cfg, train_cfg)]
        stdout, cpu = run_child(argv, env, timeout, "the Ray job")
        records = read_metrics(Path(tmp) / "overhead" / "metrics.jsonl")
    step_s, counted = steady_step_s(records, train_cfg.checkpoint_every)
    cpus = re.search(r"workers 1 x (\S+) CPU", stdout)
    checkpoints = [r["checkpoint_s"] for r in records if r.get("checkpoint_s", 0) > 0]
    steady = [r for prev, r in zip(records[:-1], records[1:], strict=True)
              if prev["optimizer_step"] % train_cfg.checkpoint_every]
    # CPU used from the first record to the checkpoint's (steady steps only): the training worker's per step, the
    # other processes' per second (Ray's services and actors poll on timers, whatever the step time)
    end = [r for r in records if r["optimizer_step"] <= train_cfg.checkpoint_every][-1]
    steps, seconds = end["optimizer_step"] - records[0]["optimizer_step"], end["time"] - records[0]["time"]
    used = cpu_between(cpu, records[0]["time"], end["time"]) if steps > 0 else {}
    is_worker = {k: k.startswith("ray::RayTrainWorker") for k in used}
    if not any(is_worker.values()):  # a Ray joined through RAY_ADDRESS: its processes are not the driver's children
        used = {}
    worker = sum(v for k, v in used.items() if is_worker[k])
    others = {k: v / seconds for k, v in used.items() if not is_worker[k]}
    return {"step_s": step_s, "steps_counted": counted, "cpus_per_worker": cpus.group(1) if cpus else None,
            "worker_cpu_s_per_step": worker / steps if used else None, "other_cpu_cores": others,
            "processes": len(nearest(cpu, (records[0]["time"] + end["time"]) / 2)) if used else None,
            "checkpoint_s": statistics.mean(checkpoints) if checkpoints else None,
            "data_wait_frac": statistics.mean(r["data_wait_frac"] for r in steady) if steady else None}


def fixed_cost(args, model_cfg: ModelConfig, train_cfg: TrainConfig) -> dict:
    from ray_jobs.demo_data import demo_data_dir

    data_dir = Path(args.data) if args.data else demo_data_dir(train_cfg.seq_len, model_cfg.vocab_size)
    D.check_compatible(D.open_prepared(data_dir), vocab_size=model_cfg.vocab_size, seq_len=train_cfg.seq_len)
    # Every run is a fresh process in the same environment (the Ray job's worker inherits it through the local Ray
    # its driver starts). The job's worker threads come from --cpus-per-worker (auto: the cores); (a) and (b) get
    # --threads (default: the cores) through OMP_NUM_THREADS, which the job's other Ray processes must not see.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.omp_wait_policy:
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy
    envs = {"bare": {**env, "OMP_NUM_THREADS": str(args.threads)}, "trainer": {**env, "OMP_NUM_THREADS": str(args.threads)},
            "ray": env}
    measure = {"bare": bare_step_s, "trainer": trainer_step_s, "ray": ray_job_step_s}
    if args.ray_poll_interval:  # (d): the job again, its Train controller draining reports more often
        envs["ray_poll"] = {**env, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(args.ray_poll_interval)}
        measure["ray_poll"] = ray_job_step_s
    runs: dict[str, list[dict]] = {name: [] for name in measure}
    loads = []
    for r in range(args.rounds):
        loads.append(load_average())
        for name, fn in measure.items():
            runs[name].append(fn(data_dir, model_cfg, train_cfg, envs[name], args.job_timeout))
        print(f"round {r + 1}/{args.rounds} (load {loads[-1]}): " + ", ".join(
            f"{k} {1e3 * v[-1]['step_s']:.2f} ms" for k, v in runs.items()), flush=True)
    median = {k: statistics.median(x["step_s"] for x in v) for k, v in runs.items()}
    loops = [k for k in runs if k != "bare"]
    cost = {k: median[k] - median["bare"] for k in loops}
    # Paired per round as well: background load that drifts between rounds then cancels out.
    paired = {k: statistics.median(x["step_s"] - b["step_s"] for x, b in zip(runs[k], runs["bare"], strict=True))
              for k in loops}
    spread = {k: (min(x["step_s"] for x in v), max(x["step_s"] for x in v)) for k, v in runs.items()}
    ray = runs["ray"]
    checkpoints = [x["checkpoint_s"] for x in ray if x["checkpoint_s"] is not None]
    labels = sorted({k for x in ray for k in x["other_cpu_cores"]})
    others = {k: statistics.median(x["other_cpu_cores"].get(k, 0.0) for x in ray) for k in labels}
    worker_cpu = [x["worker_cpu_s_per_step"] for x in ray if x["worker_cpu_s_per_step"] is not None]
    return {"data": str(data_dir), "rounds": runs, "step_s_median": median, "step_s_range": spread,
            "fixed_cost_s": cost, "fixed_cost_paired_s": paired,
            "fixed_cost_of_20ms_step": {k: v / REFERENCE_STEP_S for k, v in cost.items()},
            "ray_over_trainer_tokens_per_s": median["trainer"] / median["ray"],
            "ray_over_bare_tokens_per_s": median["bare"] / median["ray"],
            "cpus_per_worker": ray[0]["cpus_per_worker"], "load_average": loads,
            "bare_cpu_s_per_step": statistics.median(x["cpu_s_per_step"] for x in runs["bare"]),
            "ray_worker_cpu_s_per_step": statistics.median(worker_cpu) if worker_cpu else None,
            "ray_processes": ray[-1]["processes"],
            "ray_other_cpu_cores": others,
            "checkpoint_s": statistics.mean(checkpoints) if checkpoints else None,
            "data_wait_frac": statistics.median(x["data_wait_frac"] for x in ray if x["data_wait_frac"] is not None)}


# ---- main -----------------------------------------------------------------------------------------

def configs(args, preset: dict) -> tuple[ModelConfig, TrainConfig]:
    """The part's preset shape, overridden by any shape flag given."""
    shape = {**preset, **{k: getattr(args, k) for k in SHAPE_KEYS if getattr(args, k) is not None}}
    model_cfg = ModelConfig(hidden_size=shape["hidden_size"], num_hidden_layers=shape["num_hidden_layers"],
                            vocab_size=args.vocab_size)
    train_cfg = TrainConfig(seq_len=shape["seq_len"], micro_batch_size=shape["micro_batch_size"],
                            global_batch_size=shape["global_batch_size"], dtype=args.dtype, lr=DEMO_PRESET["lr"])
    return model_cfg, train_cfg


def print_fixed_cost(part1: dict, model_cfg: ModelConfig, train_cfg: TrainConfig, args) -> None:
    med, lo_hi = part1["step_s_median"], part1["step_s_range"]
    tokens = train_cfg.global_batch_size * train_cfg.seq_len
    print(f"part 1: fixed per-step cost; hidden {model_cfg.hidden_size}, {model_cfg.num_hidden_layers} layers, seq "
          f"{train_cfg.seq_len}, global batch {train_cfg.global_batch_size} (micro-batch {train_cfg.micro_batch_size}), "
          f"{train_cfg.dtype}, {args.threads} threads / Ray worker x {part1['cpus_per_worker']} CPUs; "
          f"{args.rounds} rounds of {args.steps} steps")
    labels = {"bare": "(a) bare optimizer_step loop", "trainer": "(b) Trainer in-process (minilm.train)",
              "ray": "(c) Ray job, 1 worker, default flags",
              "ray_poll": f"(d) (c), Ray Train polling every {args.ray_poll_interval} s"}
    print(f"{'run':<42}{'ms/step':>9}{'range':>17}{'tokens/s':>10}{'+ms/step':>10}{'of 20 ms':>10}")
    for k, label in ((k, v) for k, v in labels.items() if k in med):
        extra = "" if k == "bare" else (f"{1e3 * part1['fixed_cost_s'][k]:>10.2f}"
                                        f"{part1['fixed_cost_of_20ms_step'][k]:>10.1%}")
        rng = f"{1e3 * lo_hi[k][0]:.2f}-{1e3 * lo_hi[k][1]:.2f}"
        print(f"{label:<42}{1e3 * med[k]:>9.2f}{rng:>17}{tokens / med[k]:>10,.0f}{extra}")
    paired = part1["fixed_cost_paired_s"]
    print("fixed cost per step over (a), paired by round: " + ", ".join(
        f"({'bcd'[i]}) {1e3 * v:+.2f} ms" for i, v in enumerate(paired.values())) + " (target: < 5% of a 20 ms step = 1 ms)")
    print(f"Ray job / Trainer in-process: {part1['ray_over_trainer_tokens_per_s']:.3f}x tokens/s; "
          f"Ray job / bare loop: {part1['ray_over_bare_tokens_per_s']:.3f}x")
    if part1["ray_worker_cpu_s_per_step"] is not None:
        others = sorted(part1["ray_other_cpu_cores"].items(), key=lambda kv: -kv[1])
        total = sum(v for _, v in others)
        print(f"CPU per step (median of rounds): bare loop {1e3 * part1['bare_cpu_s_per_step']:.2f} ms, Ray training "
              f"worker {1e3 * part1['ray_worker_cpu_s_per_step']:.2f} ms")
        cores = len(os.sched_getaffinity(0))
        print(f"the Ray job's {part1['ray_processes'] - 1} other processes while it trains: {total:.3f} cores = {total / cores:.1%} of this "
              f"machine's {cores}; " + ", ".join(f"{k} {v:.3f}" for k, v in others[:8] if v > 0))
    if part1["data_wait_frac"] is not None:
        print(f"Ray job data wait: {part1['data_wait_frac']:.2%} of step time")
    if part1["checkpoint_s"] is not None:
        share = part1["checkpoint_s"] / (part1["checkpoint_s"] + DEMO_PRESET["checkpoint_every"] * med["ray"])
        print(f"Ray job checkpoint: {part1['checkpoint_s']:.2f} s = {share:.2%} of training time at checkpoint_every "
              f"{DEMO_PRESET['checkpoint_every']}")


def seconds_list(text: str) -> tuple[float, ...]:
    """--report-intervals: comma-separated seconds, each > 0 (argparse turns the ValueError into a usage error)."""
    values = tuple(float(x) for x in text.split(","))
    if not all(v > 0 for v in values):
        raise ValueError(text)
    return values


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["all", "fixed-cost", "ddp", "report"], default="all",
                   help="fixed-cost: part 1; ddp: part 2; report: part 3; all: every part")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps of each part-1 run")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each part (part 2: after one warm-up round)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="torch threads of runs (a) and (b); default the cores, as the job's --cpus-per-worker auto")
    p.add_argument("--log-every", type=int, default=TrainConfig.log_every)
    p.add_argument("--checkpoint-every", type=int,
                   help="part 1 (default: half the steps, so one checkpoint is timed mid-run)")
    p.add_argument("--job-timeout", type=float, default=600, help="seconds before a part-1 run is stopped")
    p.add_argument("--ray-poll-interval", type=float,
                   help="part 1: add run (d), the Ray job with RAY_TRAIN_HEALTH_CHECK_INTERVAL_S set to this (how often "
                        "Ray Train's controller takes each worker's one pending report; Ray's default is 2 s, the "
                        "job's 0.1 s); part 3: the interval compared with Ray's default (default: the job's)")
    p.add_argument("--omp-wait-policy", choices=["active", "passive"],
                   help="OMP_WAIT_POLICY of every part-1 run (default: unset, libgomp's spin-then-sleep)")
    p.add_argument("--data", help="prepared data dir for part 1 (default: the built-in demo corpus)")
    add_model_args(p, (*SHAPE_KEYS, "vocab_size"), **dict.fromkeys(SHAPE_KEYS),  # each part's own defaults
                   helps={n: f"default {FIXED_COST_PRESET[n]} in part 1, {DEMO_PRESET[n]} in part 2" for n in SHAPE_KEYS})
    p.add_argument("--reports", type=int, default=4, help="part 3: reports timed per interval (the first is not counted)")
    p.add_argument("--report-intervals", type=seconds_list, default=REPORT_INTERVALS_S,
                   help="part 3: seconds between reports, comma-separated")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.rounds < 1 or args.log_every < 1 or args.steps < 3 * args.log_every:
        p.error("--rounds and --log-every must be >= 1, and --steps >= 3 x --log-every (steady log intervals)")
    t_start = time.perf_counter()
    env = environment()
    print(f"# {env['cpu']}, {env['cpus']} CPUs, torch {env['torch']}, load average {env['load_average']}")

    part1 = part2 = part3 = None
    if args.mode in ("all", "fixed-cost"):
        model_cfg, train_cfg = configs(args, FIXED_COST_PRESET)
        train_cfg.max_steps, train_cfg.warmup_steps, train_cfg.log_every = args.steps, 1, args.log_every
        # one checkpoint about halfway, on a log step, with a steady interval before it
        train_cfg.checkpoint_every = args.checkpoint_every or max(2 * args.log_every,
                                                                  args.steps // 2 // args.log_every * args.log_every)
        part1 = fixed_cost(args, model_cfg, train_cfg)
        part1["config"] = {"model": model_cfg.to_dict(), "train": train_cfg.to_dict()}
        print_fixed_cost(part1, model_cfg, train_cfg, args)
    if args.mode in ("all", "ddp"):
        model_cfg, train_cfg = configs(args, DEMO_PRESET)
        if train_cfg.global_batch_size % (2 * train_cfg.micro_batch_size):
            p.error("part 2 has 2 workers: the global batch must be a multiple of 2 x the micro-batch")
        ensure_ray()  # after part 1: its runs must not share the CPUs with an idle Ray
        part2 = two_workers(args, model_cfg, train_cfg)
        print(f"# part 2 config: hidden {model_cfg.hidden_size}, {model_cfg.num_hidden_layers} layers, seq "
              f"{train_cfg.seq_len}, global batch {train_cfg.global_batch_size} of micro-batches of "
              f"{train_cfg.micro_batch_size}, {args.dtype}; load average {load_average()}")
        print_ddp(part2, args)
    if args.mode in ("all", "report"):
        ensure_ray()
        part3 = report_blocking(args)
        print_report_blocking(part3)
    wall = time.perf_counter() - t_start
    print(f"wall time {wall:.0f} s")
    path = write_json("overhead.json", {"args": vars(args), "environment": env, "fixed_cost": part1,
                                        "two_workers": part2, "report_blocking": part3, "wall_s": wall})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
