"""The GPU check: what minilm does on one GPU, in one command that a cold, slow lent machine fits, as one table.
Each part is a subprocess with its hard limit, in the order of `SPECS`, started only when its limit fits the time
left (`no_room`); the timings are the benchmarks' own. bench/README.md and docs/gpu.md have the parts and goals."""

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

from . import gpu_plan as P
from .common import environment, read_metrics, results_dir, steady_step_s
from .gpu_plan import BUDGET, CPU, GPU, ROWS, SPEC, Part, Runner
from .gpu_table import describe_row, failed_parts, format_table, save_results


def flags(shape: dict) -> list[str]:
    return [x for k, v in shape.items() for x in ("--" + k.replace("_", "-"), str(v))]


@dataclass
class Check:
    """What the parts share: the runner, the configs, the device, the work folder, the figures, the gates."""

    r: Runner
    s: P.Shapes
    device: str
    work: Path
    fig: dict
    gates: dict = field(default_factory=dict)  # "ray" | "compile" -> why it is closed
    data: Path | None = None  # what `prepare` wrote

    def json_part(self, name: str, args: list[str], path: Path, env: dict | None = None) -> dict | None:
        """Run a part whose command writes `path`; its JSON, or None if it did not finish."""
        part = self.r.run(name, args, env)
        if part.status != "ok" or not path.is_file():
            return None
        self.r.after_part()
        return json.loads(path.read_text())

    def sub(self, name: str, command: str, *args: str) -> dict | None:
        """`python -m bench.gpu_check COMMAND --json PATH ARGS` (bench/gpu_parts.py): its JSON."""
        path = self.r.results / f"{name}.json"
        return self.json_part(name, ["-m", "bench.gpu_check", command, "--json", str(path), *args], path)


def row_part(c: Check, name: str) -> None:
    """One row (`python -m bench.gpu_check row`) in its own process; printed and kept the moment it ends."""
    shape, extra = ROWS[name].row
    path = c.r.results / f"{name}.json"
    part = c.r.run(name, ["-m", "bench.gpu_check", "row", "--name", name, "--json", str(path), "--device", c.device,
                          "--dtype", "bf16", *c.s.row_args, *flags(getattr(c.s, shape)), *extra,
                          *c.s.row_extra.get(name, [])])
    if path.is_file():  # written before the profiler: kept if it fails
        row = c.fig.setdefault("rows", {})[name] = json.loads(path.read_text())
        part.note = describe_row(row) + ("" if part.status == "ok" else f"; then {part.status}: {part.note}")
        print(f"[{name}] row: {part.note}", flush=True)
        c.r.after_part()


def preflight_part(c: Check) -> None:
    """The preflight's versions, cold start and gates: a closed gate skips the parts behind it, nothing else."""
    found = c.fig["preflight"] = c.sub("preflight", "preflight", "--device", c.device)
    if found is None:
        return  # no gates known: every part runs and fails on its own if it must
    closed = {k: v for k, v in found["gates"].items() if v}
    c.gates.update({k: v for k, v in closed.items() if k in ("ray", "compile")})
    c.r.parts["preflight"].note = found["line"] + "".join(f"; {k} gate closed: {v}" for k, v in closed.items())
    c.r.after_part()


def trainer_ddp1_part(c: Check) -> None:
    """trainer-ddp1 (bench/gpu_parts.py) at the small shape: the Trainer plain, then DDP in a 1-rank group."""
    extra = [a for a in c.s.ddp_args if not (a == "--compile" and "compile" in c.gates)]  # eager, then
    c.fig["trainer_ddp1"] = c.sub("trainer-ddp1-26m", "trainer-ddp1", "--device", c.device, *flags(c.s.small), *extra)


def stall_part(c: Check) -> None:
    """`bench.checkpoint` at 104M on this device: the stall per checkpoint, sync vs async (pinned buffers on CUDA)."""
    shape, out = c.s.large, c.r.results / "checkpoint-stall-104m"
    found = c.json_part("checkpoint-stall-104m", [
        "-m", "bench.checkpoint", "--device", c.device, "--seq-len", str(shape["seq_len"]), "--sizes",
        f"{shape['hidden_size']}x{shape['num_hidden_layers']}", "--vocab-size", str(shape["vocab_size"]), "--repeats",
        "1", "--dir", str(c.work)], out / "checkpoint.json", env={"MINILM_BENCH_RESULTS": str(out)})
    if found:
        c.fig["checkpoint_stall"] = {k: found["rows"][0][k] for k in ("sync_stall_s", "async_stall_s", "async_write_s")}


def prepare_part(c: Check) -> None:
    from minilm.corpus import write_demo_corpus

    corpus, data = c.work / "demo-corpus.jsonl", c.work / "data"
    write_demo_corpus(corpus, **({"max_bytes": c.s.corpus_bytes} if c.s.corpus_bytes else {}))
    part = c.r.run("prepare", ["-m", "ray_jobs.prepare", "--input", str(corpus), "--output", str(data), "--seq-len",
                               str(c.s.small["seq_len"]), "--vocab-size", str(c.s.small["vocab_size"]), "--overwrite"])
    if part.status == "ok":
        found = re.search(r"[\d,]+ sequences of \d+\+1 tokens", part.output)
        part.note, c.data = found.group(0) if found else "prepared", data


def job_args(c: Check) -> list[str]:
    shape, steps = c.s.small, c.s.job_steps
    return ["-m", "ray_jobs.pretrain", "--data", str(c.data), "--use-gpu", "true" if c.device == "cuda" else "false",
            "--num-workers", "1", "--cpus-per-worker", str(c.s.cpus_per_worker), "--run-dir",
            str(c.work / "runs" / "gpu-check"), *flags(shape), "--global-batch-size", str(shape["micro_batch_size"]),
            "--dtype", "bf16", "--max-steps", str(steps), "--warmup-steps", "1", "--log-every",
            str(max(1, steps // 30)), "--checkpoint-every", str(steps)]


def ray_job_resume_part(c: Check) -> None:
    """The same command again: it must continue from the first half's checkpoint. Tokens/s of each half."""
    second = c.r.run("ray-job-resume", job_args(c))
    if second.status != "ok":
        return
    half, steps, run = c.s.job_steps // 2, c.s.job_steps, c.work / "runs" / "gpu-check"
    records = read_metrics(run / "metrics.jsonl")
    resumed = f"resumed run gpu-check at optimizer step {half}" in second.output
    second.note = f"continued from step {half}" if resumed else "did not report resuming"
    second.status = "ok" if resumed else "failed"
    halves = {}
    for key, part in (("first", [rec for rec in records if rec["optimizer_step"] <= half]),
                      ("resumed", [rec for rec in records if rec["optimizer_step"] > half])):
        step_s, counted = steady_step_s(part, steps)
        halves[key] = {"step_s": step_s, "steps_counted": counted,
                       "tokens_per_s": c.s.small["micro_batch_size"] * c.s.small["seq_len"] / step_s}
    c.fig["ray_job"] = {"halves": halves, "tokens_per_s": halves["resumed"]["tokens_per_s"],
                        "last_step": records[-1]["optimizer_step"], "resumed": resumed,
                        "data_wait_frac": [rec["data_wait_frac"] for rec in records]}


def ray_start_part(c: Check) -> None:
    """The one local Ray the Ray parts join, `ray-keeper` under this part's limit (or the cluster in RAY_ADDRESS)."""
    missing = [n for n in P.RAY_MODULES if importlib.util.find_spec(n) is None]
    if missing:
        c.gates["ray"] = (f"needs {', '.join(missing)} in this python: build the bundle (make gpu-bundle) and run "
                          f"bash bench/gpu_check.sh --bundle gpu-bundle")
        c.r.skip("ray-start", c.gates["ray"])
    elif c.r.env.get("RAY_ADDRESS"):
        c.r.parts["ray-start"] = Part("ray-start", "ok", note=f"the cluster at RAY_ADDRESS={c.r.env['RAY_ADDRESS']}")
    else:
        path = c.r.results / "ray.json"
        part = c.r.run("ray-start", ["-m", "bench.gpu_check", "ray-keeper", "--json", str(path), "--object-store-bytes",
                                     str(c.s.object_store_bytes), *(["--gpu"] if c.device == "cuda" else [])],
                       ready=path)
        if part.status == "ok":
            info = c.fig["ray"] = json.loads(path.read_text())
            c.r.env.update(RAY_ADDRESS=info.pop("address"), **info.pop("env"))
            part.note = f"a local Ray on {info['node_ip']}, {info['num_cpus']:g} CPUs"


PART_RUNS = {"preflight": preflight_part, "ray-start": ray_start_part, "trainer-ddp1-26m": trainer_ddp1_part,
             "checkpoint-stall-104m": stall_part, "prepare": prepare_part,  # ray-job: to half its steps
             "ray-job": lambda c: c.r.run("ray-job", [*job_args(c), "--exit-after-steps", str(c.s.job_steps // 2)]),
             "ray-job-resume": ray_job_resume_part, **{name: functools.partial(row_part, name=name) for name in ROWS}}


# ---- the loop ---------------------------------------------------------------------------------------------

def blocked(c: Check, spec: P.Spec) -> tuple[str, str] | None:
    """(status, why) when a part cannot run: behind a closed gate, or a need that did not succeed (or was left)."""
    if spec.ray and "ray" in c.gates:
        return "skipped", f"Ray gate closed: {c.gates['ray']}"
    if spec.row and "--compile" in spec.row[1] and "compile" in c.gates:
        return "skipped", f"compile gate closed: {c.gates['compile']}"
    for need in spec.needs:
        done = c.r.parts.get(need)
        if done is None or done.status != "ok":
            return ("left" if done and done.status == "left" else "skipped",
                    f"needs {need}, which {'did not run' if done is None else done.status}")
    return None


MIN_START_S = 10  # a headline row starts with at least this much left, whatever its limit


def no_room(c: Check, name: str, queue: list[str]) -> str | None:
    """Why a part does not start now (None: it starts): its limit, and for a part others need the cheapest of them
    after it, must fit the time actually left; a headline row starts with what there is."""
    left, limit = c.r.left(), c.r.limits[name]
    if SPEC[name].headline:
        return None if left >= MIN_START_S else f"{left:.0f} s left"
    after = [c.r.limits[n] for n in P.users(name, queue)]
    if limit + min(after, default=0.0) <= left:
        return None
    return f"its {limit:.0f} s limit{' and its cheapest user' if after else ''} did not fit the {left:.0f} s left"


def rescale(c: Check, plan: P.Plan, queue: list[str]) -> None:
    """After the preflight (the cold start, measured): if slower than assumed, every later limit grows by as much."""
    part = c.r.parts.get("preflight")
    scale = part.wall_s / P.COLD_START_S[c.device] if part is not None and part.status == "ok" else 1.0
    if scale > 1.1:
        plan.scale = min(scale, 2.0)
        c.r.limits.update({n: float(-(-c.r.limits[n] * plan.scale // 5) * 5) for n in queue})
        print(f"[plan] the cold start took {part.wall_s:.0f} s, {scale:.1f}x the {P.COLD_START_S[c.device]} s "
              f"assumed: every later limit x{plan.scale:.2f}", flush=True)


def run_parts(c: Check, plan: P.Plan) -> None:
    """Every planned part in order of value, each when the time left allows (`no_room`); Ray stopped after its last."""
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
            rescale(c, plan, queue)
        if c.r.kept is not None and not any(SPEC[n].ray for n in queue):
            c.r.stop_kept()  # the rest runs without Ray's processes beside it
            c.r.env.pop("RAY_ADDRESS", None)


def run_check(args, plan: P.Plan) -> int:
    """Every part of the plan, the results rewritten after each; a signal stops the part in flight and the check."""
    gpu = args.device == "cuda"
    dest = Path(os.environ["OUT"]) if os.environ.get("OUT") else results_dir()
    env = environment()
    title = (f"# GPU check on {env.get('gpu', 'no GPU') if gpu else env['cpu'] + ' (CPU dry run)'}, {env['cpus']} "
             f"CPUs, torch {env['torch']}, python {env['python']}, {env['time']}")
    print(title + "\n" + "\n".join(plan.lines()), flush=True)
    head = {"title": title, "environment": env, "device": args.device, "plan": plan}
    work = Path(tempfile.mkdtemp(prefix="minilm-gpu-check-"))
    runner = Runner(sys.executable, plan.budget, work, {**os.environ, "PYTHONUNBUFFERED": "1"})
    c = Check(runner, GPU if gpu else CPU, args.device, work, {})
    runner.after_part = lambda: save_results(dest, runner, c.fig, head, gpu)
    if args.bundle_error:  # a result that says so, and every part that needs no bundle
        c.gates["ray"] = f"the bundle did not install: {args.bundle_error}"
        runner.record(Part("bundle", "failed", note=args.bundle_error))
    elif args.bundle:
        runner.record(Part("bundle", "ok", note=f"installed from {args.bundle}"))
    runner.after_part()
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    for sig in signals:
        signal.signal(sig, P.on_signal)
    final = "finished"
    try:
        run_parts(c, plan)
    except P.Stopped as e:
        final = f"stopped by {e} during {next(reversed(runner.parts), 'the start')}"
        print(f"\n{final}", flush=True)
    finally:
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)  # the results are written once, whatever comes next
        runner.stop_kept()
        runner.kill_all()
        rows = save_results(dest, runner, c.fig, head, gpu, final)
        shutil.rmtree(work, ignore_errors=True)
    failed, left = failed_parts(runner), [n for n, p in runner.parts.items() if p.status == "left"]
    print(f"\n{format_table(rows)}\nwrote {', '.join(str(dest / f) for f in P.FILES)}")
    if failed:
        print(f"failed: {', '.join(failed)}")
    if left:
        print(f"left for a rerun: python -m bench.gpu_check --only {','.join(left)}")
    return 1 if failed or final != "finished" else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from .gpu_parts import COMMANDS

    if argv[:1] and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the dry run (tiny configs)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for the parts (default {BUDGET['cuda']} on the GPU, {BUDGET['cpu']} for the dry run)")
    p.add_argument("--only", default=None, help="comma-separated part names: run these (and what they need) alone")
    p.add_argument("--plan", action="store_true", help="print the plan (the parts, their limits, the total) and exit")
    p.add_argument("--bundle", default=None, help="the bundle bench/gpu_check.sh installed (for the results)")
    p.add_argument("--bundle-error", default=None,
                   help="why bench/gpu_check.sh could not install the bundle: the Ray parts are skipped, saying so")
    args = p.parse_args(argv)
    args.only = set(args.only.split(",")) if args.only else None
    if args.only and args.only - set(SPEC):
        print(f"error: --only: unknown part(s) {', '.join(sorted(args.only - set(SPEC)))}; parts: {', '.join(SPEC)}",
              file=sys.stderr)
        return 2
    plan = P.make_plan(args.device, args.budget or BUDGET[args.device], args.only)
    if args.plan:
        print("\n".join(plan.lines()))
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: torch sees no CUDA device (a CPU-only torch build, or no GPU); --device cpu is the dry run",
              file=sys.stderr)
        return 2
    return run_check(args, plan)


if __name__ == "__main__":
    sys.exit(main())
