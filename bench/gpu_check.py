"""The GPU check: what minilm does on one GPU, in one command that a cold, slow lent machine fits, as one table.

    bash bench/gpu_check.sh --bundle gpu-bundle  # on the lent GPU machine (bench/gpu_bundle.sh built the bundle)
    bash bench/gpu_check.sh --device cpu         # the dry run: CI-sized configs through the same commands
    python -m bench.gpu_check --plan             # the plan alone: every part in order, its limit, the total
    python -m bench.gpu_check --only ray-job,export   # a rerun of some parts (what they need is added)

Each part is a subprocess with its hard limit, in the order of `SPECS`, started only when its limit fits the time
left (`no_room`). The timings are the benchmarks' own. docs/gpu.md has the parts, goals and budget.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .common import environment, results_dir
from .gpu_plan import (
    ASSUME,
    BUDGET,
    CPU,
    FILES,
    GPU,
    RAY_MODULES,
    ROWS,
    SPEC,
    Part,
    Plan,
    Runner,
    Shapes,
    Spec,
    Stopped,
    make_plan,
    on_signal,
    users,
)
from .gpu_table import describe_row, failed_parts, format_table, save_results


def flags(shape: dict, *keys: str) -> list[str]:
    return [x for k in keys for x in ("--" + k.replace("_", "-"), str(shape[k]))]


def missing_modules(names) -> list[str]:
    return [n for n in names if importlib.util.find_spec(n) is None]


# ---- the parts ------------------------------------------------------------------------------------------------

SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size", "seq_len", "micro_batch_size")


@dataclass
class Check:
    """What the parts share: the runner, the configs, the device, the work folder, the figures, the gates."""

    r: Runner
    s: Shapes
    device: str
    work: Path
    fig: dict
    gates: dict = field(default_factory=dict)  # "ray" | "compile" -> why it is closed
    data: Path | None = None  # what `prepare` wrote

    def json_part(self, name: str, args: list[str], path: Path, env: dict | None = None) -> dict | None:
        """Run a part whose subcommand writes `path`; its JSON, or None if it did not finish."""
        part = self.r.run(name, args, env)
        if part.status != "ok" or not path.is_file():
            return None
        self.r.after_part()
        return json.loads(path.read_text())


def row_part(c: Check, name: str) -> None:
    """One row (`python -m bench.gpu_check row`) in its own process; printed and kept the moment it ends."""
    which, extra, _ = ROWS[name]
    shape = c.s.large if which == "large" else c.s.small
    path = c.r.results / f"{name}.json"
    args = ["-m", "bench.gpu_check", "row", "--name", name, "--json", str(path), "--device", c.device,
            "--dtype", "bf16", *c.s.row_args, *flags(shape, *SHAPE_KEYS), *extra, *c.s.row_extra.get(name, [])]
    part = c.r.run(name, args)
    row = json.loads(path.read_text()) if path.is_file() else None  # written before the profiler: kept if it fails
    if row is not None:
        c.fig.setdefault("rows", {})[name] = row
        part.note = describe_row(row) + ("" if part.status == "ok" else f"; then {part.status}: {part.note}")
        print(f"[{name}] row: {c.r.parts[name].note}", flush=True)
        c.r.after_part()


def preflight_part(c: Check) -> None:
    """The preflight's versions, cold start and gates: a closed gate skips the parts behind it, nothing else."""
    path = c.r.results / "preflight.json"
    found = c.json_part("preflight", ["-m", "bench.gpu_check", "preflight", "--device", c.device, "--json",
                                      str(path)], path)
    c.fig["preflight"] = found
    if found is None:
        return  # no gates known: every part runs and fails on its own if it must
    c.gates.update({k: v for k, v in found["gates"].items() if v and k in ("ray", "compile")})
    c.r.parts["preflight"].note = found["line"] + "".join(f"; {k} gate closed: {v}" for k, v in found["gates"].items()
                                                          if v)
    c.r.after_part()


def group_part(c: Check, name: str, command: str) -> None:
    """ddp1 or trainer-ddp1 (bench/gpu_parts.py) at the small shape; its figures under the command's name."""
    path = c.r.results / f"{name}.json"
    extra = c.s.ddp_args if command == "ddp1" else c.s.trainer_ddp_args
    extra = [a for a in extra if not (a == "--compile" and "compile" in c.gates)]  # eager, then
    c.fig[command.replace("-", "_")] = c.json_part(name, ["-m", "bench.gpu_check", command, "--device", c.device,
                                                          "--json", str(path), *flags(c.s.small, *SHAPE_KEYS), *extra],
                                                   path)


def fp16_part(c: Check) -> None:
    part = c.r.run("fp16", ["-m", "bench.fp16_check", "--device", c.device, *c.s.fp16_args],
                   env={"MINILM_BENCH_RESULTS": str(c.r.results / "fp16")})
    path = c.r.results / "fp16" / "fp16_check.json"
    if part.status in ("ok", "failed") and path.is_file():
        c.fig["fp16"] = json.loads(path.read_text())


def trainer_part(c: Check) -> None:
    """`python -m minilm.train` at the small shape on random ids: the Trainer's wall time per step."""
    from .overhead import read_metrics, steady_step_s

    shape, steps = c.s.small, c.s.trainer_steps
    run_dir = c.work / "trainer"
    sequences = 4 * shape["micro_batch_size"]
    args = ["-m", "minilm.train", "--random-tokens", str(sequences * (shape["seq_len"] + 1)), "--run-dir", str(run_dir),
            *flags(shape, *SHAPE_KEYS),
            "--global-batch-size", str(shape["micro_batch_size"]), "--dtype", "bf16",
            "--max-steps", str(steps), "--warmup-steps", "1", "--log-every", str(max(1, steps // 20)),
            "--checkpoint-every", str(steps), "--val-samples", str(shape["micro_batch_size"])]
    part = c.r.run("trainer", args)
    if part.status != "ok":
        return
    records = read_metrics(run_dir / "metrics.jsonl")
    step_s, counted = steady_step_s(records, steps)
    shutil.rmtree(run_dir, ignore_errors=True)
    val = [rec["val_loss"] for rec in records if "val_loss" in rec]
    if not val:
        part.status, part.note = "failed", "no val_loss (--val-samples) in its metrics"
    c.fig["trainer"] = {"step_s": step_s, "steps_counted": counted, "val_loss": val[-1] if val else None,
                        "tokens_per_s": shape["micro_batch_size"] * shape["seq_len"] / step_s}


CHECKPOINT_FIGURES = {"checkpoint": ("params", "save_s", "restore_s", "resume_bytes", "export_bytes"),
                      "checkpoint_stall": ("sync_stall_s", "async_stall_s", "async_write_s")}


def checkpoint_part(c: Check, name: str, stall: bool) -> None:
    """`bench.checkpoint` at the 104M size on this machine's disk: save (resume state + export) and restore, or with
    `stall` on this device the training thread's stall per checkpoint, sync against async (pinned buffers on CUDA)."""
    shape, out, key = c.s.large, c.r.results / name, "checkpoint_stall" if stall else "checkpoint"
    mode = ["--mode", "stall", "--device", c.device, "--seq-len", str(shape["seq_len"])] if stall else []
    found = c.json_part(name, ["-m", "bench.checkpoint", *mode, "--sizes",
                               f"{shape['hidden_size']}x{shape['num_hidden_layers']}", "--vocab-size",
                               str(shape["vocab_size"]), "--repeats", "1", "--dir", str(c.work)],
                        out / f"{key}.json", env={"MINILM_BENCH_RESULTS": str(out)})
    if found:
        c.fig[key] = {k: found["rows"][0][k] for k in CHECKPOINT_FIGURES[key]}


def prepare_part(c: Check) -> None:
    from minilm.corpus import write_demo_corpus

    corpus = c.work / "demo-corpus.jsonl"
    if c.s.corpus_bytes:
        write_demo_corpus(corpus, max_bytes=c.s.corpus_bytes)
    else:
        write_demo_corpus(corpus)
    data = c.work / "data"
    part = c.r.run("prepare", ["-m", "ray_jobs.prepare", "--input", str(corpus), "--output", str(data), "--seq-len",
                               str(c.s.small["seq_len"]), "--vocab-size", str(c.s.small["vocab_size"]), "--overwrite"])
    if part.status == "ok":
        found = re.search(r"[\d,]+ sequences of \d+\+1 tokens", part.output)
        part.note = found.group(0) if found else "prepared"
        c.data = data


def job_args(c: Check) -> list[str]:
    shape = c.s.small
    return ["-m", "ray_jobs.pretrain", "--data", str(c.data), "--use-gpu", "true" if c.device == "cuda" else "false",
            "--num-workers", "1", "--cpus-per-worker", str(c.s.cpus_per_worker), "--storage-path",
            str(c.work / "runs"), "--name", "gpu-check", *flags(shape, *SHAPE_KEYS),
            "--global-batch-size", str(shape["micro_batch_size"]), "--dtype", "bf16", "--max-steps",
            str(c.s.job_steps), "--warmup-steps", "1", "--log-every", str(max(1, c.s.job_steps // 30)),
            "--checkpoint-every", str(c.s.job_steps)]


def ray_job_part(c: Check) -> None:
    """Train to half the steps (--exit-after-steps); `ray_job_resume_part` continues to the end."""
    c.r.run("ray-job", [*job_args(c), "--exit-after-steps", str(c.s.job_steps // 2)])


def ray_job_resume_part(c: Check) -> None:
    """The same command again: it must continue from the first half's checkpoint. Tokens/s of each half."""
    from .overhead import read_metrics, steady_step_s

    second = c.r.run("ray-job-resume", job_args(c))
    if second.status != "ok":
        return
    half, steps, run = c.s.job_steps // 2, c.s.job_steps, c.work / "runs" / "gpu-check"
    records = read_metrics(run / "metrics.jsonl")
    resumed = f"resumed run gpu-check at optimizer step {half}" in second.output
    second.note = f"continued from step {half}" if resumed else "did not report resuming"
    if not resumed:
        second.status = "failed"
    tokens = c.s.small["micro_batch_size"] * c.s.small["seq_len"]
    halves = {}
    for key, part in (("first", [rec for rec in records if rec["optimizer_step"] <= half]),
                      ("resumed", [rec for rec in records if rec["optimizer_step"] > half])):
        step_s, counted = steady_step_s(part, steps)
        halves[key] = {"step_s": step_s, "steps_counted": counted, "tokens_per_s": tokens / step_s}
    checkpoints = sorted(p for p in run.glob("checkpoint_*") if p.is_dir())
    c.fig["ray_job"] = {"halves": halves, "tokens_per_s": halves["resumed"]["tokens_per_s"],
                        "last_step": records[-1]["optimizer_step"], "resumed": resumed,
                        "checkpoint": str(checkpoints[-1]) if checkpoints else None,
                        "data_wait_frac": [rec["data_wait_frac"] for rec in records]}


def export_part(c: Check) -> None:
    if not (c.fig.get("ray_job") or {}).get("checkpoint"):
        c.r.skip("export", "no checkpoint from the Ray job")
        return
    c.r.run("export", ["-m", "ray_jobs.export", "--checkpoint", c.fig["ray_job"]["checkpoint"], "--output",
                       str(c.work / "export")])


def sample_part(c: Check) -> None:
    part = c.r.run("sample", ["-m", "minilm.sample", "--checkpoint", str(c.work / "export"), "--prompt", "Return the",
                              "--max-new-tokens", "24"])
    text = " ".join(part.output.split()) if part.status == "ok" else ""
    if part.status == "ok" and not text:
        part.status, part.note = "failed", "sampled nothing"
    c.fig["sample"] = text or None


def stream_part(c: Check) -> None:
    """One rank's `RankStream` (the job's own pipeline) driven alone on the prepared data: `stream_rate`.
    (`bench.data --mode stream` measures the same on a synthetic dataset of its own, too big for this budget.)"""
    shape = c.s.small
    part = c.r.run("stream", ["-m", "bench.gpu_check", "stream-rate", "--data", str(c.data), *flags(shape, *SHAPE_KEYS),
                              "--steps", str(c.s.stream_steps), "--global-batch-size", str(shape["micro_batch_size"]),
                              "--device", c.device])
    found = re.search(r"stream delivery rate: ([\d,]+) tokens/s", part.output) if part.status == "ok" else None
    if found:
        c.fig["stream"] = {"tokens_per_s": float(found.group(1).replace(",", "")), "by": "ray_jobs.stream.RankStream",
                           "to": c.device}


def ray_start_part(c: Check) -> None:
    """The one local Ray the Ray parts join (RAY_ADDRESS), `ray-keeper` under this part's limit; none when
    RAY_ADDRESS names a cluster already."""
    missing = missing_modules(RAY_MODULES)
    if missing:
        c.gates["ray"] = (f"needs {', '.join(missing)} in this python: build the bundle (make gpu-bundle) and run "
                          f"bash bench/gpu_check.sh --bundle gpu-bundle")
        c.r.skip("ray-start", c.gates["ray"])
        return
    if c.r.env.get("RAY_ADDRESS"):
        c.r.parts["ray-start"] = Part("ray-start", "ok", note=f"the cluster at RAY_ADDRESS={c.r.env['RAY_ADDRESS']}")
        return
    path = c.r.results / "ray.json"
    part = c.r.run("ray-start", ["-m", "bench.gpu_check", "ray-keeper", "--json", str(path), "--object-store-bytes",
                                 str(c.s.object_store_bytes), *(["--gpu"] if c.device == "cuda" else [])], ready=path)
    if part.status == "ok":
        info = json.loads(path.read_text())
        c.r.env.update(RAY_ADDRESS=info.pop("address"), **info.pop("env"))
        c.fig["ray"] = info
        part.note = f"a local Ray on {info['node_ip']}, {info['num_cpus']:g} CPUs"


P = functools.partial
PART_RUNS = {"preflight": preflight_part, "ray-start": ray_start_part, "ddp1-26m": P(group_part, name="ddp1-26m", command="ddp1"),
             "trainer-ddp1-26m": P(group_part, name="trainer-ddp1-26m", command="trainer-ddp1"),
             "fp16": fp16_part, "trainer": trainer_part,
             "checkpoint-104m": P(checkpoint_part, name="checkpoint-104m", stall=False),
             "checkpoint-stall-104m": P(checkpoint_part, name="checkpoint-stall-104m", stall=True),
             "prepare": prepare_part, "ray-job": ray_job_part, "ray-job-resume": ray_job_resume_part,
             "export": export_part, "sample": sample_part, "stream": stream_part,
             **{name: P(row_part, name=name) for name in ROWS}}


# ---- main ---------------------------------------------------------------------------------------------------

def blocked(c: Check, spec: Spec) -> tuple[str, str] | None:
    """(status, why) when a part cannot run: skipped behind a closed gate or a need that did not succeed, left
    behind a need that was left."""
    if spec.ray and "ray" in c.gates:
        return "skipped", f"Ray gate closed: {c.gates['ray']}"
    if spec.name in ROWS and "--compile" in ROWS[spec.name][1] and "compile" in c.gates:
        return "skipped", f"compile gate closed: {c.gates['compile']}"
    for need in spec.needs:
        done = c.r.parts.get(need)
        if done is None or done.status != "ok":
            status = "left" if done is not None and done.status == "left" else "skipped"
            return status, f"needs {need}, which {'did not run' if done is None else done.status}"
    return None


MIN_START_S = 10  # a headline row starts with at least this much left, whatever its limit


def no_room(c: Check, name: str, queue: list[str]) -> str | None:
    """Why a part does not start now, from the time actually left: its limit (and, for a part others need, the
    cheapest of them after it) must fit; a headline row starts with what there is. None: it starts."""
    left, limit = c.r.left(), c.r.limits[name]
    if SPEC[name].headline:
        return None if left >= MIN_START_S else f"{left:.0f} s left"
    after = [c.r.limits[n] for n in users(name, queue)]
    need = limit + min(after, default=0.0)
    if need <= left:
        return None
    return f"its {limit:.0f} s limit{' and its cheapest user' if after else ''} did not fit the {left:.0f} s left"


def rescale(c: Check, plan: Plan, queue: list[str], only: set[str] | None) -> None:
    """After the preflight (the cold start, measured): if it took longer than assumed, every later limit grows by
    as much (up to 2x); the parts then start as the time left allows, most valuable first."""
    part = c.r.parts.get("preflight")
    scale = part.wall_s / ASSUME[c.device].cold_start if part is not None and part.status == "ok" else 1.0
    if scale <= 1.1:
        return
    new = make_plan(c.device, c.r.left(), only, done=tuple(c.r.parts), scale=min(scale, 2.0), compiled={"tiny"})
    print(f"[plan] the cold start took {part.wall_s:.0f} s, {scale:.1f}x the {ASSUME[c.device].cold_start:g} s "
          f"assumed: every later limit x{new.scale:.2f}, within the {c.r.left():.0f} s left", flush=True)
    print("\n".join(new.lines()[2:]), flush=True)
    plan.scale = new.scale
    c.r.limits.update({n: lim for n, lim in new.limits.items() if n in queue})


def run_parts(c: Check, plan: Plan, only: set[str] | None) -> None:
    """Every planned part in order of value, each started only when the time actually left allows it (`no_room`),
    so time the parts before it did not use runs it; the local Ray stopped after the last Ray part."""
    queue = [n for n in SPEC if n in plan.limits]
    c.r.limits.update(plan.limits)
    while queue:
        name = queue.pop(0)
        why = blocked(c, SPEC[name])
        room = None if why else no_room(c, name, queue)
        if why:
            c.r.skip(name, why[1], why[0])
        elif room:
            c.r.skip(name, f"left for a rerun ({room}): --only {name}", "left")
        else:
            PART_RUNS[name](c)
        if name == "preflight":
            rescale(c, plan, queue, only)
        if c.r.kept is not None and not any(SPEC[n].ray for n in queue):
            c.r.stop_kept()  # the rest runs without Ray's processes beside it
            c.r.env.pop("RAY_ADDRESS", None)


def check(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the dry run (tiny configs)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for the parts (default {BUDGET['cuda']} on the GPU, {BUDGET['cpu']} for the dry run)")
    p.add_argument("--only", default=None, help="comma-separated part names: run these (and what they need) alone")
    p.add_argument("--plan", action="store_true", help="print the plan (the parts, their limits, the total) and exit")
    p.add_argument("--bundle", default=None, help="the bundle bench/gpu_check.sh installed (for the results)")
    p.add_argument("--bundle-error", default=None,
                   help="why bench/gpu_check.sh could not install the bundle: the Ray parts are skipped, saying so")
    args = p.parse_args(argv)
    only = args.only = set(args.only.split(",")) if args.only else None
    if only and only - set(SPEC):
        print(f"error: --only: unknown part(s) {', '.join(sorted(only - set(SPEC)))}; parts: {', '.join(SPEC)}",
              file=sys.stderr)
        return 2
    budget = args.budget or BUDGET[args.device]
    plan = make_plan(args.device, budget, only)
    if args.plan:
        print("\n".join(plan.lines()))
        return 0
    import torch

    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        print("error: torch sees no CUDA device (a CPU-only torch build, or no GPU); --device cpu is the dry run",
              file=sys.stderr)
        return 2
    return run_check(args, plan, budget)


def run_check(args, plan: Plan, budget: float) -> int:
    """Every part of the plan, the results rewritten after each; a signal stops the part in flight and the check."""
    gpu = args.device == "cuda"
    s = GPU if gpu else CPU
    dest = Path(os.environ["OUT"]) if os.environ.get("OUT") else results_dir()
    env = environment()
    title = (f"# GPU check on {env.get('gpu', 'no GPU') if gpu else env['cpu'] + ' (CPU dry run)'}, {env['cpus']} "
             f"CPUs, torch {env['torch']}, python {env['python']}, {env['time']}")
    print(title, flush=True)
    print("\n".join(plan.lines()), flush=True)
    head = {"title": title, "environment": env, "device": args.device, "plan": plan}
    work = Path(tempfile.mkdtemp(prefix="minilm-gpu-check-"))
    runner = Runner(sys.executable, budget, work, {**os.environ, "PYTHONUNBUFFERED": "1"})
    c = Check(runner, s, args.device, work, {})
    runner.after_part = lambda: save_results(dest, runner, c.fig, head, gpu)
    if args.bundle_error:  # a result that says so, and every part that needs no bundle
        c.gates["ray"] = f"the bundle did not install: {args.bundle_error}"
        runner.record(Part("bundle", "failed", note=args.bundle_error))
    elif args.bundle:
        runner.record(Part("bundle", "ok", note=f"installed from {args.bundle}"))
    runner.after_part()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    final = "finished"
    try:
        run_parts(c, plan, args.only)
    except Stopped as e:
        final = f"stopped by {e} during {next(reversed(runner.parts), 'the start')}"
        print(f"\n{final}", flush=True)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # the results are written once, whatever comes next
        runner.stop_kept()
        runner.kill_all()
        rows = save_results(dest, runner, c.fig, head, gpu, final)
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(format_table(rows))
    failed = failed_parts(runner, c.fig)
    print(f"wrote {', '.join(str(dest / f) for f in FILES)}")
    if failed:
        print(f"failed: {', '.join(failed)}")
    left = [n for n, p in runner.parts.items() if p.status == "left"]
    if left:
        print(f"left for a rerun: python -m bench.gpu_check --only {','.join(left)}")
    return 1 if failed or final != "finished" else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["preflight"]:
        from .gpu_preflight import preflight

        return preflight(argv[1:])
    from .gpu_parts import COMMANDS

    return COMMANDS[argv[0]](argv[1:]) if argv[:1] and argv[0] in COMMANDS else check(argv)


if __name__ == "__main__":
    sys.exit(main())
