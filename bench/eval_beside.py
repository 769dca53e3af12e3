"""What scoring checkpoints beside training costs the training: each round runs the demo job (`python -m
ray_jobs.pretrain`) with and without --eval-tasks, alternating which goes first; the ratio of the training records'
median tokens/s with and without is what evaluation beside training costs a step."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import add_model_args, child_env, read_metrics

ROOT = Path(__file__).resolve().parent.parent


def run(run_dir: Path, args: list[str]) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ray_jobs.pretrain", "--run-dir", str(run_dir), *args], cwd=ROOT,
                          env=child_env(PYTHONUNBUFFERED="1"), capture_output=True, text=True)  # its own local Ray
    if proc.returncode != 0:
        sys.exit(f"error: {run_dir.name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    tokens_per_step = train[-1]["tokens_seen"] / train[-1]["optimizer_step"]
    return {"step_s": tokens_per_step / statistics.median(r["tokens_per_s"] for r in train[1:]),
            "wall_s": time.perf_counter() - t0, "scores": [r for r in records if "eval_task" in r],
            "eval_lines": [line for line in proc.stdout.splitlines() if line.startswith(("eval  ", "best  "))]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.eval_beside", description=__doc__)
    add_model_args(p, ("rounds", "max_steps", "checkpoint_every", "log_every"), rounds=1, max_steps=40,
                   checkpoint_every=10, log_every=5)
    p.add_argument("--eval-resources", default="CPU=1")
    args = p.parse_args(argv)
    from ray_jobs.demo_tasks import write_tasks

    results: dict[str, list[dict]] = {"without": [], "with": []}
    with tempfile.TemporaryDirectory(prefix="bench-eval-beside-") as tmp:
        listing = write_tasks(Path(tmp) / "tasks")
        flags = ["--max-steps", str(args.max_steps), "--checkpoint-every", str(args.checkpoint_every),
                 "--log-every", str(args.log_every)]
        for i in range(args.rounds):
            for kind in (["without", "with"] if i % 2 == 0 else ["with", "without"]):
                extra = ["--eval-tasks", str(listing), "--eval-resources", args.eval_resources] if kind == "with" else []
                results[kind].append(run(Path(tmp) / "runs" / f"{kind}-{i}", flags + extra))
                print(f"round {i + 1} {kind:>7} evaluation: step {results[kind][-1]['step_s'] * 1e3:.0f} ms, "
                      f"command {results[kind][-1]['wall_s']:.0f} s", flush=True)
    step = {k: statistics.median(r["step_s"] for r in v) for k, v in results.items()}
    last = results["with"][-1]
    print("\nthe run with evaluation, as its console showed the scores:\n" + "\n".join(
        "  " + line for line in last["eval_lines"]))
    print(f"\nscores in metrics.jsonl: {len(last['scores'])} records ("
          f"{len({r['optimizer_step'] for r in last['scores']})} checkpoints)")
    print(f"step time with evaluation / without: {step['with'] / step['without']:.3f} "
          f"({step['with'] * 1e3:.0f} ms / {step['without'] * 1e3:.0f} ms, median of {args.rounds} round(s), "
          f"{os.cpu_count()} cores, --eval-resources {args.eval_resources})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
