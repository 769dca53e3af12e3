"""The GPU check's table (one row per check: what was measured, the goal, PASS / BELOW GOAL on a GPU, `dry run` on
CPU, or the part's failure) and its three result files."""

from __future__ import annotations

import dataclasses
import io
import json
import statistics
import tarfile
from pathlib import Path

from minilm.config import TrainConfig

from .common import table, write_atomic
from .gpu_plan import DDP1_GOAL, FILES, RAY_GOAL, ROWS, Part
from .step import MFU_GOALS


def describe_row(row: dict) -> str:
    sheet = row["mfu_datasheet"] is not None
    text = (f"{row['tokens_per_s']:,.0f} tok/s, MFU {row['mfu_datasheet'] if sheet else row['mfu']:.1%}"
            + (f" (of the measured matmul peak: {row['mfu']:.1%})" if sheet else " (of the measured peak)"))
    if row.get("peak_memory_bytes") is not None:
        text += f", peak memory {row['peak_memory_bytes'] / 2**30:.2f} GiB ({row['peak_memory_of']})"
    if row.get("compile_s") is not None:
        text += (f", compile ({row['compile']}) {row['compile_s']:.1f} s, {row['graph_breaks']} graph break(s), {row['recompiles']} "
                 f"recompile(s)")
    text += f", MoE dispatch {row['moe_dispatch']}" if row.get("moe_dispatch") else ""
    text += f", SDPA {row['sdpa']['kernel']}" if row.get("sdpa") else ""
    if row.get("profile"):
        text += (f"; profiler failed: {row['profile']['error']}" if "error" in row["profile"] else
                 f"; profiled step: flash attention {'used' if row['profile']['flash'] else 'NOT used'}")
    return text


def table_rows(parts: dict[str, Part], fig: dict, gpu: bool) -> list[dict]:
    """One row per check: what was measured, the goal, and PASS / BELOW GOAL (GPU), `dry run` (CPU), or the failure."""
    rows: list[dict] = []

    def add(check: str, part: str, result: str, goal: str = "-", ok: bool | None = None) -> None:
        done = parts.get(part, Part(part, note="not in this run's plan"))
        if done.status != "ok":
            result, status = done.note or "not run", done.status.upper()
        else:
            status = "dry run" if not gpu else "-" if ok is None else "PASS" if ok else "BELOW GOAL"
        rows.append({"check": check, "status": status, "goal": goal, "result": result})

    measured = fig.get("rows") or {}
    if "bundle" in parts:
        add("bundle install (Ray and what it needs)", "bundle", parts["bundle"].note, "installs")
    add("preflight", "preflight", (fig.get("preflight") or {}).get("line", ""))
    for name, spec in ROWS.items():
        goal = MFU_GOALS.get(name.split("-")[1]) if name.startswith("step-") and name.endswith("-compiled") else None
        row = measured.get(name)
        mfu = row and (row["mfu_datasheet"] if row["mfu_datasheet"] is not None else row["mfu"])
        add(spec.check, name, describe_row(row) if row else "", f">= {goal:.0%} MFU" if goal else "-",
            None if goal is None or row is None else mfu >= goal)
    tddp = fig.get("trainer_ddp1")
    add("Trainer in a 1-rank group, DDP (NCCL; gloo on CPU), 26M", "trainer-ddp1-26m",
        "" if not tddp else f"{tddp['backend']}{', compiled' if tddp['compile'] else ''}: "
                            f"{tddp['runs']['ddp']['tokens_per_s']:,.0f} tok/s = {tddp['ddp_over_plain']:.3f}x the "
                            f"plain Trainer's, losses within {tddp['max_relative_difference']:.1e}",
        f">= {DDP1_GOAL:.2f}x the plain Trainer", None if not tddp else tddp["ddp_over_plain"] >= DDP1_GOAL)
    stall, step = fig.get("checkpoint_stall"), measured.get("step-104m-compiled") or measured.get("step-104m-eager")
    result, every = "", TrainConfig().checkpoint_every
    if stall:
        result = (f"sync {stall['sync_stall_s']:.3f} s, async {stall['async_stall_s']:.3f} s ("
                  f"{stall['async_stall_s'] / stall['sync_stall_s']:.1%}), written in the background in "
                  f"{stall['async_write_s']:.2f} s")
    if stall and step:
        result += "; " + " / ".join(f"{s / (s + every * step['step_s_median']):.2%}" for s in (
            stall["sync_stall_s"], stall["async_stall_s"])) + f" of wall time at checkpoint_every {every} (the 104M step)"
    add("checkpoint stall per save, sync vs async, 104M", "checkpoint-stall-104m", result, "async < 10% of sync",
        None if not stall else stall["async_stall_s"] < 0.1 * stall["sync_stall_s"])
    eager, job = measured.get("step-26m-eager"), fig.get("ray_job") or {"halves": {}}
    trainer = (fig.get("trainer_ddp1") or {}).get("runs", {}).get("plain")  # the Trainer in-process, no group
    for run, check, part in ((trainer, "Trainer in-process (trainer-ddp1's plain run), 26M", "trainer-ddp1-26m"),
                             (job["halves"].get("first"), "Ray job 1 worker, 26M, to half its steps", "ray-job"),
                             (job["halves"].get("resumed"), "  resumed to the end", "ray-job-resume")):
        ratio = run["tokens_per_s"] / eager["tokens_per_s"] if run and eager else None
        result = "" if not run else f"{run['tokens_per_s']:,.0f} tok/s" + (
            f" = {ratio:.3f}x the eager step" if ratio else "")
        if part == "ray-job-resume" and part in parts:
            result += f"; {parts[part].note}"
        add(check, part, result, f">= {RAY_GOAL:.2f}x the eager step", None if ratio is None else ratio >= RAY_GOAL)
    for check, part, goal in (("the local Ray (ray-start)", "ray-start", "starts"),
                              ("prepare the demo corpus", "prepare", "completes")):
        add(check, part, parts[part].note if part in parts else "", goal)
    waits = job.get("data_wait_frac") or []  # each log interval's: how long the Ray Data stream kept the device waiting
    wait = statistics.median(waits) if waits else None
    add("Ray job data wait (its Ray Data stream)", "ray-job-resume", "" if wait is None else
        f"{wait:.2%} of step time (median of {len(waits)} log intervals)", "< 2%", None if wait is None else wait < 0.02)
    return rows


def format_table(rows: list[dict]) -> str:
    keys = ("check", "status", "goal", "result")
    return table(list(keys), [[r[k] for k in keys] for r in rows], left=len(keys))


def save_results(dest: Path, runner, fig: dict, head: dict, gpu: bool, final: str = "") -> list[dict]:
    """Rewrite the three result files from what is known now (after every part, and at the end)."""
    rows, plan = table_rows(runner.parts, fig, gpu), head["plan"]
    parts = {k: {"status": v.status, "wall_s": v.wall_s, "limit_s": runner.limits.get(k), "note": v.note}
             for k, v in runner.parts.items()}
    payload = {**head, "plan": {**dataclasses.asdict(plan), "total_s": plan.total}, "table": rows, "figures": fig,
               "parts": parts, "finished": final}
    write_atomic(dest / FILES[0], json.dumps(payload, indent=2, default=str) + "\n")
    failed = failed_parts(runner)
    write_atomic(dest / FILES[1], "\n".join([head["title"], "", format_table(rows), "", *(
        [f"failed: {', '.join(failed)}"] if failed else []), final or f"in progress: {len(runner.parts)} part(s) done"])
        + "\n")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for folder in (runner.logs, runner.results):
            tar.add(folder, arcname=folder.name)
    write_atomic(dest / FILES[2], buf.getvalue())
    return rows


def failed_parts(runner) -> list[str]:
    return [p.name for p in runner.parts.values() if p.status in ("failed", "timeout", "stopped")]  # not: left
