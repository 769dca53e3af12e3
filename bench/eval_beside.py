"""What scoring checkpoints beside training costs the training: the demo job with and without --eval-tasks.

    python -m bench.eval_beside                       # the demo preset, 40 steps, a checkpoint every 10
    python -m bench.eval_beside --rounds 2 --max-steps 60

Each round runs `python -m ray_jobs.pretrain` twice, alternating which goes first; the ratio of the training
records' median tokens/s with and without is what evaluation beside training costs a step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(storage: Path, name: str, args: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ray_jobs.pretrain", "--storage-path", str(storage), "--name", name,
                           *args], cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"error: {name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    records = [json.loads(x) for x in (storage / name / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    rates = [r["tokens_per_s"] for r in train[1:]]
    tokens_per_step = train[-1]["tokens_seen"] / train[-1]["optimizer_step"]
    return {"step_s": tokens_per_step / statistics.median(rates), "wall_s": wall,
            "eval_lines": [line for line in proc.stdout.splitlines() if line.startswith(("eval  ", "best  "))],
            "scores": [r for r in records if "eval_task" in r]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.eval_beside", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--eval-resources", default="CPU=1")
    args = p.parse_args(argv)
    from ray_jobs.demo_tasks import write_tasks

    with tempfile.TemporaryDirectory(prefix="bench-eval-beside-") as tmp:
        tmp = Path(tmp)
        listing = write_tasks(tmp / "tasks")
        flags = ["--max-steps", str(args.max_steps), "--checkpoint-every", str(args.checkpoint_every),
                 "--log-every", str(args.log_every)]
        results: dict[str, list[dict]] = {"without": [], "with": []}
        for i in range(args.rounds):
            order = ["without", "with"] if i % 2 == 0 else ["with", "without"]
            for kind in order:
                extra = ["--eval-tasks", str(listing), "--eval-resources", args.eval_resources] if kind == "with" else []
                results[kind].append(run(tmp / "runs", f"{kind}-{i}", flags + extra))
                print(f"round {i + 1} {kind:>7} evaluation: step {results[kind][-1]['step_s'] * 1e3:.0f} ms, "
                      f"command {results[kind][-1]['wall_s']:.0f} s", flush=True)
    step = {k: statistics.median(r["step_s"] for r in v) for k, v in results.items()}
    last = results["with"][-1]
    print("\nthe run with evaluation, as its console showed the scores:")
    for line in last["eval_lines"]:
        print("  " + line)
    print(f"\nscores in metrics.jsonl: {len(last['scores'])} records ("
          f"{len({r['optimizer_step'] for r in last['scores']})} checkpoints)")
    print(f"step time with evaluation / without: {step['with'] / step['without']:.3f} "
          f"({step['with'] * 1e3:.0f} ms / {step['without'] * 1e3:.0f} ms, median of {args.rounds} round(s), "
          f"{os.cpu_count()} cores, --eval-resources {args.eval_resources})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
