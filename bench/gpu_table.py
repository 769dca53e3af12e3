"""The GPU check's table (one row per check: what was measured, the goal, PASS / BELOW GOAL on a GPU, `dry run` on
CPU, or the part's failure) and its three result files."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

from minilm.config import TrainConfig

from .gpu_plan import DDP1_GOAL, FILES, RAY_GOAL, ROWS, Part
from .step import MFU_GOALS


def describe_row(row: dict) -> str:
    sheet = row["mfu_datasheet"] is not None
    mfu = row["mfu_datasheet"] if sheet else row["mfu"]
    text = (f"{row['tokens_per_s']:,.0f} tok/s, MFU {mfu:.1%}"
            + (f" (of the measured matmul peak: {row['mfu']:.1%})" if sheet else " (of the measured peak)"))
    if row.get("peak_memory_bytes") is not None:
        text += f", peak memory {row['peak_memory_bytes'] / 2**30:.2f} GiB ({row['peak_memory_of']})"
    if row["compile"]:
        text += (f", compile {row['compile_s']:.1f} s, {row['graph_breaks']} graph break(s), "
                 f"{row['recompiles']} recompile(s)")
    if row.get("moe_dispatch"):
        text += f", MoE dispatch {row['moe_dispatch']}"
    if row.get("sdpa"):
        text += f", SDPA {row['sdpa']['kernel']}"
    if row.get("profile"):
        text += (f"; profiler failed: {row['profile']['error']}" if "error" in row["profile"] else
                 f"; profiled step: flash attention {'used' if row['profile']['flash'] else 'NOT used'}")
    return text



# ---- the table ----------------------------------------------------------------------------------------------

ROW_CHECKS = {name: check for name, (_, _, check) in ROWS.items()}


def table_rows(parts: dict[str, Part], fig: dict, gpu: bool) -> list[dict]:
    """One row per check: what was measured, the goal, and PASS / BELOW GOAL (a GPU run), `dry run` (CPU), or the
    part's failure (FAILED, TIMEOUT, STOPPED, SKIPPED with its reason)."""
    rows: list[dict] = []
    add = adder(parts, gpu, rows)
    if "bundle" in parts:
        add("bundle install (Ray and what it needs)", "bundle", parts["bundle"].note, "installs")
    add("preflight", "preflight", (fig.get("preflight") or {}).get("line", ""))
    step_rows(add, fig)
    fp16_row(add, rows, fig)
    parallel_rows(add, fig)
    job_rows(add, fig, parts)
    return rows


def adder(parts: dict[str, Part], gpu: bool, rows: list[dict]):
    """add(check, part, result, goal, ok): a row, its status from the part's outcome and whether the goal was met."""

    def add(check: str, part: str, result: str, goal: str = "-", ok: bool | None = None) -> None:
        done = parts.get(part, Part(part, note="not in this run's plan"))
        if done.status != "ok":
            result, status = done.note or "not run", done.status.upper()
        elif ok is None:
            status = "-" if gpu else "dry run"
        else:
            status = ("PASS" if ok else "BELOW GOAL") if gpu else "dry run"
        rows.append({"check": check, "status": status, "goal": goal, "result": result})
    return add


def step_rows(add, fig: dict) -> None:
    measured = fig.get("rows") or {}
    for name, check in ROW_CHECKS.items():
        found = measured.get(name)
        goal = MFU_GOALS.get(name.split("-")[1]) if name.startswith("step-") and name.endswith("-compiled") else None
        if found is None:
            add(check, name, "", f">= {goal:.0%} MFU" if goal else "-")
            continue
        mfu = found["mfu_datasheet"] if found["mfu_datasheet"] is not None else found["mfu"]
        add(check, name, describe_row(found), f">= {goal:.0%} MFU" if goal else "-", None if goal is None else mfu >= goal)


def fp16_row(add, rows: list[dict], fig: dict) -> None:
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


def parallel_rows(add, fig: dict) -> None:
    """DDP and the Trainer in a 1-rank group, the checkpoint's cost and its stall."""
    measured = fig.get("rows") or {}
    ddp = fig.get("ddp1")
    add("DDP in a 1-rank group (NCCL; gloo on CPU), 26M, accumulation 2", "ddp1-26m",
        "" if not ddp else f"{ddp['backend']}{', compiled' if ddp['compile'] else ''}: {ddp['steps']} steps, losses "
                           f"within {ddp['max_relative_difference']:.1e} of the plain model's",
        "the plain model's losses (1e-3)", None if not ddp else ddp["max_relative_difference"] <= 1e-3)
    tddp = fig.get("trainer_ddp1")
    add("Trainer in a 1-rank group, DDP (NCCL; gloo on CPU), 26M", "trainer-ddp1-26m",
        "" if not tddp else f"{tddp['backend']}{', compiled' if tddp['compile'] else ''}: "
                            f"{tddp['runs']['ddp']['tokens_per_s']:,.0f} tok/s = {tddp['ddp_over_plain']:.3f}x the "
                            f"plain Trainer's, losses within {tddp['max_relative_difference']:.1e}",
        f">= {DDP1_GOAL:.2f}x the plain Trainer", None if not tddp else tddp["ddp_over_plain"] >= DDP1_GOAL)
    ckpt, step = fig.get("checkpoint"), measured.get("step-104m-compiled") or measured.get("step-104m-eager")
    every = TrainConfig().checkpoint_every
    share = ckpt["save_s"] / (ckpt["save_s"] + every * step["step_s_median"]) if ckpt and step else None
    add("checkpoint save + restore, 104M", "checkpoint-104m",
        "" if not ckpt else f"save {ckpt['save_s']:.2f} s, restore {ckpt['restore_s']:.2f} s"
        + (f"; {share:.2%} of wall time at checkpoint_every {every} (the 104M step)" if share is not None else ""),
        "< 2% of wall time", None if share is None else share < 0.02)

    stall = fig.get("checkpoint_stall")
    add("checkpoint stall per save, sync vs async, 104M", "checkpoint-stall-104m",
        "" if not stall else f"sync {stall['sync_stall_s']:.3f} s, async {stall['async_stall_s']:.3f} s "
                             f"({stall['async_stall_s'] / stall['sync_stall_s']:.1%}), written in the background in "
                             f"{stall['async_write_s']:.2f} s",
        "async < 10% of sync", None if not stall else stall["async_stall_s"] < 0.1 * stall["sync_stall_s"])


def job_rows(add, fig: dict, parts: dict[str, Part]) -> None:
    """The Trainer and the Ray job against the eager step, prepare, export + sample, the stream's rate."""
    measured = fig.get("rows") or {}
    eager = measured.get("step-26m-eager")
    job = fig.get("ray_job") or {"halves": {}}
    for run, check, part in ((fig.get("trainer"), "Trainer in-process (minilm.train), 26M", "trainer"),
                             (job["halves"].get("first"), "Ray job 1 worker, 26M, to half its steps", "ray-job"),
                             (job["halves"].get("resumed"), "  resumed to the end", "ray-job-resume")):
        ratio = run["tokens_per_s"] / eager["tokens_per_s"] if run and eager else None
        result = "" if not run else f"{run['tokens_per_s']:,.0f} tok/s" + (
            f" = {ratio:.3f}x the eager step" if ratio else "")
        if part == "ray-job-resume" and "ray-job-resume" in parts:
            result += f"; {parts['ray-job-resume'].note}"
        add(check, part, result, f">= {RAY_GOAL:.2f}x the eager step", None if ratio is None else ratio >= RAY_GOAL)
    add("the local Ray (ray-start)", "ray-start", parts["ray-start"].note if "ray-start" in parts else "", "starts")
    add("prepare the demo corpus", "prepare", parts["prepare"].note if "prepare" in parts else "", "completes")
    add("export + sample", "sample", repr((fig.get("sample") or "")[:80]), "text comes out")
    fastest = measured.get("step-26m-compiled") or eager
    stream, need = fig.get("stream"), fastest["tokens_per_s"] if fastest else None
    add("Ray Data stream delivery", "stream", f"{stream['tokens_per_s']:,.0f} tok/s to {stream['to']} ({stream['by']})"
        if stream else "no rate found", f">= {need:,.0f} tok/s (the 26M step)" if need else "-",
        None if not stream or not need else stream["tokens_per_s"] >= need)


def format_table(rows: list[dict]) -> str:
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in ("check", "status", "goal")}
    lines = [f"{'check':<{widths['check']}}  {'status':<{widths['status']}}  {'goal':<{widths['goal']}}  result"]
    for r in rows:
        lines.append(f"{r['check']:<{widths['check']}}  {r['status']:<{widths['status']}}  "
                     f"{r['goal']:<{widths['goal']}}  {r['result']}")
    return "\n".join(lines)


# ---- the results ------------------------------------------------------------------------------------------

def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def save_results(dest: Path, runner, fig: dict, head: dict, gpu: bool, final: str = "") -> list[dict]:
    """Rewrite the three result files from what is known now (after every part, and at the end)."""
    dest.mkdir(parents=True, exist_ok=True)
    rows = table_rows(runner.parts, fig, gpu)
    parts = {k: {"status": v.status, "wall_s": v.wall_s, "limit_s": runner.limits.get(k), "note": v.note}
             for k, v in runner.parts.items()}
    plan = head["plan"]
    payload = {**head, "plan": {"budget_s": plan.budget, "total_s": plan.total, "scale": plan.scale,
                                "parts": plan.parts, "left": plan.left, "added": plan.added},
               "table": rows, "figures": fig, "parts": parts, "finished": final}
    write_atomic(dest / FILES[0], (json.dumps(payload, indent=2, default=str) + "\n").encode())
    failed = failed_parts(runner, fig)
    summary = [head["title"], "", format_table(rows), ""]
    summary += [f"failed: {', '.join(failed)}"] if failed else []
    summary += [final or f"in progress: {len(runner.parts)} part(s) done"]
    write_atomic(dest / FILES[1], ("\n".join(summary) + "\n").encode())
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for folder in (runner.logs, runner.results):
            tar.add(folder, arcname=folder.name)
    write_atomic(dest / FILES[2], buf.getvalue())
    return rows


def failed_parts(runner, fig: dict) -> list[str]:
    failed = [p.name for p in runner.parts.values() if p.status in ("failed", "timeout", "stopped")]  # not: left
    failed += [] if not fig.get("fp16") or fig["fp16"]["passed"] else ["fp16"]
    return list(dict.fromkeys(failed))


