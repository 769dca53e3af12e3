"""The GPU check (issue #14 item 7): what minilm does on one GPU, in one run of under 8 minutes, as one table.

    bash bench/gpu_check.sh                      # on a machine with one CUDA GPU (the shell picks the python)
    bash bench/gpu_check.sh --device cpu         # the dry run: CI-sized configs through the same commands
    python -m bench.gpu_check --device cuda      # what the shell script runs

Each part is a subprocess with a hard time limit, and the whole stays within --budget seconds (a part that
would start past it is reported as skipped):

  step-26m, step-104m  `bench.step` bf16, dense, eager and --compile: MiniMind-26M (hidden 512, 8 layers, micro-batch
                       32: MiniMind's batch) and MiniMind-104M (hidden 768, 16 layers, micro-batch 128: nanochat's 64k
                       tokens per step), seq 512: tokens/s and MFU
  fp16                 `bench.fp16_check`: 50 steps of fp16 with the GradScaler, an overflow injected
  trainer              `python -m minilm.train` on random tokens at the 26M shape: the Trainer alone, no Ray
  prepare              the demo corpus through `python -m ray_jobs.prepare` at seq 512
  ray-job              `python -m ray_jobs.pretrain --use-gpu true --num-workers 1` at the 26M shape, stopped
                       halfway by --exit-after-steps and run again to continue (--resume auto); the first half
                       with RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=2 (Ray's default: its Train controller polls every 2 s,
                       and a report made sooner waits, `bench.overhead --mode report`), the second with the job's
                       own setting (0.1 s)
  export, sample       `python -m ray_jobs.export` of the last checkpoint, `python -m minilm.sample` from it
  stream               the Ray Data stream's delivery rate on this machine's CPUs at seq 512, micro-batch 32:
                       one rank's `ray_jobs.stream.RankStream` (the job's pipeline) driven here alone

The Trainer and the Ray job are compared with `bench.step`'s eager 26M row (the same shape, dtype and batch,
no compile): tokens/s from wall time per step between their metrics records, log steps included.
Goals (H100/H200-class GPU): 104M compiled >= 40% MFU, 26M compiled >= 25% (MFU against the data-sheet
peak where minilm.progress lists the GPU, as the training loop's MFU; the measured matmul peak
otherwise), the Ray job within 5% of `bench.step`; the stream must feed at least the 26M step's tokens/s.
Without ray (or pyarrow, tokenizers, yaml) the Ray parts are skipped with one line saying what to install.

Writes gpu_check.json (the table and every part's figures) and logs/<part>.log to bench/results/gpu/ (or
$MINILM_BENCH_RESULTS); the sub-benchmarks' JSON go to subfolders there. Exit status 1 if a part failed or
timed out or a correctness check (fp16, resume, export, sample) failed; a goal missed is marked in the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .common import environment, results_dir, write_json

MFU_GOALS = {"step-26m": 0.25, "step-104m": 0.40}  # compiled bf16, H100/H200 class (nanochat: ~41% at ~110M)
RAY_GOAL = 0.95  # the Ray job's tokens/s over bench.step's, same config
RAY_MODULES = ("ray", "pyarrow", "tokenizers", "yaml")


@dataclass
class Shapes:
    """The configs of one check: the real ones on a GPU, tiny ones for the CPU dry run."""

    small: dict  # MiniMind-26M: bench.step, fp16, the Trainer, the Ray job
    large: dict  # MiniMind-104M: bench.step only
    job_steps: int  # the Ray job's optimizer steps (it exits halfway and resumes)
    trainer_steps: int
    step_args: list[str]  # bench.step's timing flags
    fp16_args: list[str]
    corpus_bytes: int | None  # the demo corpus, cut to this size (None: whole)
    stream_steps: int
    limits: dict = field(default_factory=dict)  # seconds per part


GPU = Shapes(
    small={"hidden_size": 512, "num_hidden_layers": 8, "vocab_size": 6400, "seq_len": 512, "micro_batch_size": 32},
    # 104M at nanochat's 64k tokens per step (its ~41% MFU at ~110M); 26M at MiniMind's 32 x 512 (the 20 ms step)
    large={"hidden_size": 768, "num_hidden_layers": 16, "vocab_size": 6400, "seq_len": 512, "micro_batch_size": 128},
    job_steps=300, trainer_steps=200, step_args=["--steps", "20", "--warmup", "5"], fp16_args=[],
    corpus_bytes=None, stream_steps=400,
    limits={"step-26m": 110, "step-104m": 130, "fp16": 60, "trainer": 60, "prepare": 60, "ray-job": 80,
            "ray-job-resume": 80, "export": 30, "sample": 30, "stream": 60})
CPU = Shapes(
    small={"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 512, "seq_len": 64, "micro_batch_size": 4},
    large={"hidden_size": 64, "num_hidden_layers": 3, "vocab_size": 512, "seq_len": 64, "micro_batch_size": 4},
    job_steps=8, trainer_steps=12, step_args=["--steps", "2", "--warmup", "1", "--peak-size", "256"],
    fp16_args=["--micro-batch-size", "2", "--seq-len", "32", "--hidden-size", "64", "--num-hidden-layers", "2",
               "--vocab-size", "1024"],
    corpus_bytes=200_000, stream_steps=20,
    limits={"step-26m": 300, "step-104m": 300, "fp16": 180, "trainer": 120, "prepare": 120, "ray-job": 180,
            "ray-job-resume": 180, "export": 60, "sample": 60, "stream": 120})


# ---- running a part ---------------------------------------------------------------------------------------

@dataclass
class Part:
    name: str
    status: str = "skipped"  # ok | failed | timeout | skipped
    wall_s: float = 0.0
    note: str = ""
    output: str = ""


class Runner:
    """Runs each part as a subprocess with a hard limit inside the overall budget; logs go to logs/<part>.log."""

    def __init__(self, python: str, budget_s: float, logs: Path, env: dict):
        self.python, self.deadline, self.logs, self.env = python, time.monotonic() + budget_s, logs, env
        self.parts: dict[str, Part] = {}
        logs.mkdir(parents=True, exist_ok=True)

    def skip(self, name: str, why: str) -> Part:
        part = self.parts[name] = Part(name, "skipped", note=why)
        print(f"[{name}] skipped: {why}", flush=True)
        return part

    def run(self, name: str, args: list[str], limit: float, env: dict | None = None) -> Part:
        left = self.deadline - time.monotonic()
        if left < 5:
            return self.skip(name, "out of time (--budget)")
        timeout = min(limit, left)
        print(f"[{name}] {' '.join(args)}  (limit {timeout:.0f} s)", flush=True)
        t0 = time.monotonic()
        proc = subprocess.Popen([self.python, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**self.env, **(env or {})}, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
            status = "ok" if proc.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            out = stop_group(proc)
            status = "timeout"
        part = Part(name, status, time.monotonic() - t0, output=out or "")
        if status == "failed":
            part.note = f"exit {proc.returncode}: {last_line(part.output)}"
        elif status == "timeout":
            part.note = f"stopped at its {timeout:.0f} s limit"
        (self.logs / f"{name}.log").write_text(part.output)
        print(f"[{name}] {status} in {part.wall_s:.0f} s{': ' + part.note if part.note else ''}", flush=True)
        self.parts[name] = part
        return part


def stop_group(proc: subprocess.Popen) -> str:
    """SIGTERM to the part's process group (a Ray driver then shuts down the local Ray it started), SIGKILL after
    15 s; returns what it printed."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.communicate(timeout=wait)[0] or ""
        except subprocess.TimeoutExpired:
            continue
    return ""


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:") or "Error" in line.split(":")[0]]
    return (errors or lines or ["(no output)"])[-1][:200]


def flags(shape: dict, *keys: str) -> list[str]:
    return [x for k in keys for x in ("--" + k.replace("_", "-"), str(shape[k]))]


def missing_modules(names) -> list[str]:
    return [n for n in names if importlib.util.find_spec(n) is None]


# ---- the parts ------------------------------------------------------------------------------------------------

def step_part(r: Runner, name: str, shape: dict, s: Shapes, device: str, out: Path) -> dict | None:
    args = ["-m", "bench.step", "--device", device, "--dtype", "bf16", "--compile", "--no-moe", *s.step_args,
            *flags(shape, "hidden_size", "num_hidden_layers", "vocab_size", "seq_len", "micro_batch_size")]
    part = r.run(name, args, s.limits[name], env={"MINILM_BENCH_RESULTS": str(out / name)})
    if part.status != "ok":
        return None
    result = json.loads((out / name / "step.json").read_text())["results"][0]
    return {r_["config"]: r_ for r_ in result["rows"]} | {"peak_flops": result["peak_flops"],
                                                           "peak_flops_datasheet": result["peak_flops_datasheet"]}


def fp16_part(r: Runner, s: Shapes, device: str, out: Path) -> dict | None:
    part = r.run("fp16", ["-m", "bench.fp16_check", "--device", device, *s.fp16_args], s.limits["fp16"],
                 env={"MINILM_BENCH_RESULTS": str(out / "fp16")})
    path = out / "fp16" / "fp16_check.json"
    if part.status not in ("ok", "failed") or not path.is_file():
        return None
    return json.loads(path.read_text())


def trainer_part(r: Runner, s: Shapes, device_flags: dict, work: Path) -> dict | None:
    """`python -m minilm.train` at the small shape on random ids: the Trainer's wall time per step."""
    from .overhead import read_metrics, steady_step_s

    shape, steps = s.small, s.trainer_steps
    run_dir = work / "trainer"
    sequences = 4 * shape["micro_batch_size"]
    args = ["-m", "minilm.train", "--random-tokens", str(sequences * (shape["seq_len"] + 1)), "--run-dir", str(run_dir),
            *flags(shape, "hidden_size", "num_hidden_layers", "vocab_size", "seq_len", "micro_batch_size"),
            "--global-batch-size", str(shape["micro_batch_size"]), "--dtype", device_flags["dtype"],
            "--max-steps", str(steps), "--warmup-steps", "1", "--log-every", str(max(1, steps // 20)),
            "--checkpoint-every", str(steps)]
    part = r.run("trainer", args, s.limits["trainer"])
    if part.status != "ok":
        return None
    step_s, counted = steady_step_s(read_metrics(run_dir / "metrics.jsonl"), steps)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"step_s": step_s, "steps_counted": counted,
            "tokens_per_s": shape["micro_batch_size"] * shape["seq_len"] / step_s}


def prepare_part(r: Runner, s: Shapes, work: Path) -> Path | None:
    from minilm.corpus import write_demo_corpus

    corpus = work / "demo-corpus.jsonl"
    if s.corpus_bytes:
        write_demo_corpus(corpus, max_bytes=s.corpus_bytes)
    else:
        write_demo_corpus(corpus)
    data = work / "data"
    part = r.run("prepare", ["-m", "ray_jobs.prepare", "--input", str(corpus), "--output", str(data), "--seq-len",
                             str(s.small["seq_len"]), "--vocab-size", str(s.small["vocab_size"]), "--overwrite"],
                 s.limits["prepare"])
    if part.status == "ok":
        found = re.search(r"[\d,]+ sequences of \d+\+1 tokens", part.output)
        part.note = found.group(0) if found else "prepared"
        return data
    return None


RAY_DEFAULT_POLL = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2"}  # the first half: Ray's default, which the job overrides


def ray_job_part(r: Runner, s: Shapes, data: Path, use_gpu: str, work: Path) -> dict | None:
    """Train to half the steps (--exit-after-steps), then the same command again continues to the end. The first
    half runs with Ray Train's controller polling every 2 s (Ray's default; `bench.overhead --mode report`: a loop
    that reports more often than the controller polls waits in ray.train.report), the resumed half with the job's
    0.1 s, so the two halves compare them at this machine's step time."""
    from .overhead import read_metrics, steady_step_s

    shape, steps = s.small, s.job_steps
    storage, name, half = work / "runs", "gpu-check", s.job_steps // 2
    args = ["-m", "ray_jobs.pretrain", "--data", str(data), "--use-gpu", use_gpu, "--num-workers", "1",
            "--storage-path", str(storage), "--name", name,
            *flags(shape, "hidden_size", "num_hidden_layers", "vocab_size", "seq_len", "micro_batch_size"),
            "--global-batch-size", str(shape["micro_batch_size"]), "--dtype", "bf16", "--max-steps", str(steps),
            "--warmup-steps", "1", "--log-every", str(max(1, steps // 30)), "--checkpoint-every", str(steps)]
    first = r.run("ray-job", [*args, "--exit-after-steps", str(half)], s.limits["ray-job"], env=RAY_DEFAULT_POLL)
    if first.status != "ok":
        return None
    second = r.run("ray-job-resume", args, s.limits["ray-job-resume"])
    if second.status != "ok":
        return None
    records = read_metrics(storage / name / "metrics.jsonl")
    resumed = f"resumed run {name} at optimizer step {half}" in second.output
    second.note = f"continued from step {half}" if resumed else "did not report resuming"
    if not resumed:
        second.status = "failed"
    tokens = shape["micro_batch_size"] * shape["seq_len"]
    halves = {}
    for key, part in (("poll_2s", [rec for rec in records if rec["optimizer_step"] <= half]),
                      ("poll_0.1s", [rec for rec in records if rec["optimizer_step"] > half])):
        step_s, counted = steady_step_s(part, steps)
        halves[key] = {"step_s": step_s, "steps_counted": counted, "tokens_per_s": tokens / step_s}
    checkpoints = sorted(p for p in (storage / name).glob("checkpoint_*") if p.is_dir())
    return {"halves": halves, "tokens_per_s": halves["poll_0.1s"]["tokens_per_s"],
            "last_step": records[-1]["optimizer_step"], "resumed": resumed,
            "checkpoint": str(checkpoints[-1]) if checkpoints else None,
            "data_wait_frac": [rec["data_wait_frac"] for rec in records]}


def export_and_sample(r: Runner, s: Shapes, checkpoint: str, work: Path) -> str | None:
    out = work / "export"
    if r.run("export", ["-m", "ray_jobs.export", "--checkpoint", checkpoint, "--output", str(out)],
             s.limits["export"]).status != "ok":
        return None
    part = r.run("sample", ["-m", "minilm.sample", "--weights", str(out), "--prompt", "Return the",
                            "--max-new-tokens", "24"], s.limits["sample"])
    if part.status != "ok":
        return None
    text = " ".join(part.output.split())
    if not text:
        part.status, part.note = "failed", "sampled nothing"
        return None
    return text


def stream_part(r: Runner, s: Shapes, data: Path) -> dict | None:
    """One rank's `RankStream` (the job's own pipeline) driven alone on the prepared data: `stream_rate`.
    (`bench.data --mode stream` measures the same on a synthetic dataset of its own, too big for this budget.)"""
    shape = s.small
    part = r.run("stream", ["-m", "bench.gpu_check", "stream-rate", "--data", str(data), "--seq-len",
                            str(shape["seq_len"]), "--vocab-size", str(shape["vocab_size"]), "--micro-batch-size",
                            str(shape["micro_batch_size"]), "--steps", str(s.stream_steps), "--global-batch-size",
                            str(shape["micro_batch_size"])], s.limits["stream"])
    if part.status != "ok":
        return None
    found = re.search(r"stream delivery rate: ([\d,]+) tokens/s", part.output)
    return {"tokens_per_s": float(found.group(1).replace(",", "")), "by": "ray_jobs.stream.RankStream"} if found else None


# ---- the stream's delivery rate (no model in the loop) ------------------------------------------------------

def stream_rate(argv: list[str]) -> int:
    """Drive one rank's `RankStream` (world size 1, micro-batches to host memory) with nothing else in the loop."""
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check stream-rate")
    p.add_argument("--data", required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=400, help="optimizer steps timed after the first (pipeline start)")
    args = p.parse_args(argv)
    import numpy as np
    import torch

    from minilm import data as D
    from ray_jobs.cli import ensure_ray

    ensure_ray()
    from ray_jobs.stream import RankStream

    prepared = D.open_prepared(args.data)
    D.check_compatible(prepared, vocab_size=args.vocab_size, seq_len=args.seq_len)
    train_ids = np.arange(prepared.num_sequences, dtype=np.int64)
    per_epoch = D.steps_per_epoch(len(train_ids), args.global_batch_size)
    stream = RankStream(data_dir=args.data, train_ids=train_ids, seed=0, global_batch_size=args.global_batch_size,
                        micro_batch_size=args.micro_batch_size, world_size=1, rank=0, start_step=0,
                        total_steps=args.steps + 1, steps_per_epoch=per_epoch, device=torch.device("cpu"))
    t0 = time.perf_counter()
    stream.next_step()
    start_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(args.steps):
        micro_batches, _ = stream.next_step()
        tokens += sum(b.shape[0] * (b.shape[1] - 1) for b in micro_batches)
    elapsed = time.perf_counter() - t0
    print(f"pipeline start {start_s:.2f} s; {args.steps} steps of {args.global_batch_size} x {args.seq_len} tokens in "
          f"{elapsed:.2f} s ({per_epoch} steps per epoch)")
    print(f"stream delivery rate: {tokens / elapsed:,.0f} tokens/s")
    return 0


# ---- the table ----------------------------------------------------------------------------------------------

def table_rows(parts: dict[str, Part], fig: dict, gpu: bool) -> list[dict]:
    """One row per check: what was measured, the goal, and PASS / BELOW GOAL (a GPU run), `dry run` (CPU), or the
    part's failure (FAILED, TIMEOUT, SKIPPED with its reason)."""
    rows = []

    def add(check: str, part: str, result: str, goal: str = "-", ok: bool | None = None) -> None:
        done = parts.get(part, Part(part))
        if done.status != "ok":
            result, status = done.note or "not run", done.status.upper()
        elif ok is None:
            status = "-" if gpu else "dry run"
        else:
            status = ("PASS" if ok else "BELOW GOAL") if gpu else "dry run"
        rows.append({"check": check, "status": status, "goal": goal, "result": result})

    for name, size in (("step-26m", "26M"), ("step-104m", "104M")):
        for config, kind in (("dense", "eager"), ("dense+compile", "compiled")):
            row = (fig.get(name) or {}).get(config)
            goal = MFU_GOALS[name] if kind == "compiled" else None
            if row is None:
                add(f"bench.step {size} bf16 {kind}", name, "")
                continue
            sheet = row["mfu_datasheet"] is not None
            mfu = row["mfu_datasheet"] if sheet else row["mfu"]
            result = (f"{row['tokens_per_s']:,.0f} tok/s, MFU {mfu:.1%}"
                      + (f" (of the measured matmul peak: {row['mfu']:.1%})" if sheet else " (of the measured peak)"))
            add(f"bench.step {size} bf16 {kind}", name, result, f">= {goal:.0%} MFU" if goal else "-",
                None if goal is None else mfu >= goal)

    fp16 = fig.get("fp16")
    if fp16:
        changes = "; ".join(f"step {c['step']} {c['from']:g}->{c['to']:g}" for c in fp16["scale_changes"]) or "none"
        checks = ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in fp16["checks"].items())
        rows.append({"check": f"fp16 + GradScaler, {len(fp16['steps'])} steps",
                     "status": "PASS" if fp16["passed"] else "FAILED", "goal": "finite, loss falls, overflow skipped",
                     "result": f"loss {fp16['loss_first10']:.2f} -> {fp16['loss_last10']:.2f}, "
                               f"{fp16['skipped_steps']} skipped, scale changes: {changes}; {checks}"})
    else:
        add("fp16 + GradScaler", "fp16", "")

    eager = (fig.get("step-26m") or {}).get("dense")
    job = fig.get("ray_job") or {"halves": {}}
    for run, check, part in ((fig.get("trainer"), "Trainer in-process (minilm.train), 26M", "trainer"),
                             (job["halves"].get("poll_2s"), "Ray job 1 worker, 26M, Train polling every 2 s", "ray-job"),
                             (job["halves"].get("poll_0.1s"), "  resumed with the job's 0.1 s polling", "ray-job-resume")):
        ratio = run["tokens_per_s"] / eager["tokens_per_s"] if run and eager else None
        result = "" if not run else f"{run['tokens_per_s']:,.0f} tok/s" + (
            f" = {ratio:.3f}x bench.step eager" if ratio else "")
        if part == "ray-job-resume" and "ray-job-resume" in parts:
            result += f"; {parts['ray-job-resume'].note}"
        add(check, part, result, f">= {RAY_GOAL:.2f}x bench.step", None if ratio is None else ratio >= RAY_GOAL)
    add("prepare the demo corpus", "prepare", parts["prepare"].note if "prepare" in parts else "", "completes")
    add("export + sample", "sample", repr((fig.get("sample") or "")[:80]), "text comes out")
    stream, need = fig.get("stream"), eager["tokens_per_s"] if eager else None
    add("Ray Data stream delivery, CPU", "stream", f"{stream['tokens_per_s']:,.0f} tok/s ({stream['by']})"
        if stream else "no rate found", f">= {need:,.0f} tok/s (the 26M step)" if need else "-",
        None if not stream or not need else stream["tokens_per_s"] >= need)
    return rows


def print_table(rows: list[dict]) -> None:
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in ("check", "status", "goal")}
    print(f"{'check':<{widths['check']}}  {'status':<{widths['status']}}  {'goal':<{widths['goal']}}  result")
    for r in rows:
        print(f"{r['check']:<{widths['check']}}  {r['status']:<{widths['status']}}  {r['goal']:<{widths['goal']}}  "
              f"{r['result']}")


# ---- main ---------------------------------------------------------------------------------------------------

def check(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the dry run (tiny configs)")
    p.add_argument("--budget", type=float, default=450, help="seconds for every part together (default 450)")
    p.add_argument("--keep-work", action="store_true", help="keep the data, runs and export (a temporary folder)")
    args = p.parse_args(argv)
    import torch

    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        print("error: torch sees no CUDA device (a CPU-only torch build, or no GPU); --device cpu is the dry run",
              file=sys.stderr)
        return 2
    s = GPU if gpu else CPU
    out = results_dir()
    env = environment()
    print(f"# GPU check on {env.get('gpu', 'no GPU') if gpu else env['cpu'] + ' (CPU dry run)'}, {env['cpus']} CPUs, "
          f"torch {env['torch']}, {env['time']}", flush=True)
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    runner = Runner(sys.executable, args.budget, out / "logs", child_env)
    work = Path(tempfile.mkdtemp(prefix="minilm-gpu-check-"))
    fig: dict = {}
    try:
        fig["step-26m"] = step_part(runner, "step-26m", s.small, s, args.device, out)
        fig["step-104m"] = step_part(runner, "step-104m", s.large, s, args.device, out)
        fig["fp16"] = fp16_part(runner, s, args.device, out)
        fig["trainer"] = trainer_part(runner, s, {"dtype": "bf16"}, work)
        missing = missing_modules(RAY_MODULES)
        if missing:
            why = (f"needs {', '.join(missing)} in this python: pip install 'ray[train,data]>=2.60' pyarrow tokenizers "
                   f"pyyaml (offline: carry wheels and pip install --no-index .whl/*.whl)")
            for name in ("prepare", "ray-job", "ray-job-resume", "export", "sample", "stream"):
                runner.skip(name, why)
        else:
            data = prepare_part(runner, s, work)
            if data is not None:
                fig["ray_job"] = ray_job_part(runner, s, data, "true" if gpu else "false", work)
                if fig["ray_job"] and fig["ray_job"]["checkpoint"]:
                    fig["sample"] = export_and_sample(runner, s, fig["ray_job"]["checkpoint"], work)
                fig["stream"] = stream_part(runner, s, data)
    finally:
        if args.keep_work:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    rows = table_rows(runner.parts, fig, gpu)
    print()
    print_table(rows)
    failed = [p.name for p in runner.parts.values() if p.status in ("failed", "timeout")]
    failed += [] if not fig.get("fp16") or fig["fp16"]["passed"] else ["fp16"]
    path = write_json("gpu_check.json", {"environment": env, "device": args.device, "table": rows, "figures": fig,
                                         "parts": {k: {"status": v.status, "wall_s": v.wall_s, "note": v.note}
                                                   for k, v in runner.parts.items()}})
    print(f"wrote {path}; logs in {out / 'logs'}")
    if failed:
        print(f"failed: {', '.join(dict.fromkeys(failed))}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["stream-rate"]:
        return stream_rate(argv[1:])
    return check(argv)


if __name__ == "__main__":
    sys.exit(main())
