"""Evaluate checkpoints on fixed tasks (multiple choice, bits per byte, greedy generations), off the training path.

    python -m ray_jobs.evaluate --run-dir runs/run1 --tasks tasks.yaml --output runs/run1/eval.jsonl
    python -m ray_jobs.evaluate --checkpoint runs/run1/checkpoint_00001000 --tasks tasks.yaml --output eval.jsonl
    python -m ray_jobs.evaluate --run-dir runs/run1 --follow --resources CPU=2 --tasks tasks.yaml --output eval.jsonl

Each (checkpoint, task) pair becomes one JSON line of --output; a pair already there is not evaluated again, so
rerunning after more checkpoints were written scores only the new ones. The task formats: docs/evaluation.md.
The work runs in this process (no Ray); each checkpoint is one call of `minilm.evaluate.evaluate_checkpoint`. With
--follow, each checkpoint is a Ray task instead (a local Ray, or the cluster of RAY_ADDRESS: `ray job submit`), and
the command goes on scoring new checkpoints while the run is live. The flags every command shares: minilm.cli
(`--run` is the old spelling of `--run-dir`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from minilm import checkpoint as C
from minilm.eval_log import append_records, scored_keys
from minilm.evaluate import evaluate_checkpoint, format_scores, identify
from minilm.tasks import TaskError, load_tasks
from minilm.tokenizer import TokenizerError

from .cli import ArgumentParser, UsageError, command, fail


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m ray_jobs.evaluate", description=__doc__.split("\n")[0], epilog=__doc__)
    p.add_argument("--checkpoint", action="append", default=[],
                   help="a checkpoint folder written by training (checkpoint_XXXXXXXX), RUN_DIR/best (the run's best "
                        "checkpoint, best.json) or a weights export; repeatable (default: none)")
    p.add_argument("--run-dir", help="a run folder: every complete checkpoint in it, oldest first (default: none)")
    p.rename("--run-dir", "--run")
    p.add_argument("--tasks", required=True, help="the task list (YAML or JSON): name, kind, path, options")
    p.add_argument("--output", required=True, help="results JSONL, appended to (pairs already there are skipped)")
    p.add_argument("--tokenizer", help="tokenizer.json, for a checkpoint without one (default: the checkpoint's "
                                       "weights/tokenizer.json, an export's tokenizer.json, else that of another "
                                       "checkpoint of the run)")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:1...")
    p.add_argument("--follow", action="store_true", help="with --run-dir: score each checkpoint as it appears, by a "
                                                         "Ray task on --resources, until the run ends (its lease is "
                                                         "gone)")
    p.add_argument("--resources", default="CPU=1", help="with --follow: the Ray resources of each scoring task")
    return p


@command(C.CheckpointError, TaskError, TokenizerError, UsageError)
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.checkpoint and not args.run_dir:
        return fail("give --checkpoint PATH (repeatable) or --run-dir DIR")
    if args.follow and (args.checkpoint or not args.run_dir):
        return fail("--follow goes with --run-dir DIR alone (it scores the run's checkpoints as they appear)")
    try:
        tasks = load_tasks(args.tasks)  # every item read and checked before any checkpoint is loaded
        if args.follow:
            return follow(args, tasks)
        done = scored_keys(Path(args.output))
        # A checkpoint named on the command line must be sound; one of --run-dir that is not is passed over, as
        # training's --resume auto does (it may be still being written, or torn by a crash).
        checkpoints = [(C.resolve(path), True) for path in args.checkpoint] + \
            [(path, False) for path in (run_checkpoints(args.run_dir) if args.run_dir else [])]
        device = resolve_device(args.device)
        table = Table()
        for path, named in checkpoints:
            try:
                evaluate_one(path, tasks, done, args, device, table)
            except C.CheckpointError as e:
                if named:
                    raise
                print(f"skipping checkpoint: {e}", file=sys.stderr)
    except OSError as e:
        return fail(f"{getattr(e, 'filename', None) or args.output}: {e.strerror or e}")
    return 0


def follow(args: argparse.Namespace, tasks: list) -> int:
    """--follow: a Ray task per checkpoint (ray_jobs.evaluator, as beside training), while the run holds its lease;
    then the last ones are scored and the command ends."""
    from .cli import ensure_ray, parse_eval_resources
    from .evaluator import Evaluator

    resources = parse_eval_resources(args.resources)
    folder = local_run_folder(args.run_dir)
    ensure_ray()
    evaluator = Evaluator(args.run_dir, args.tasks, tasks, resources, folder.local.name, best_metric=None,
                          tokenizer=args.tokenizer, output=Path(args.output)).start()
    print(f"following {args.run_dir}: each checkpoint scored as it appears, until the run ends", flush=True)
    wait_s = float("inf")
    try:
        while C.Lease(folder).live():
            time.sleep(2.0)  # the run ends when its lease is gone: looked at every 2 s
    except KeyboardInterrupt:
        print("stopped: what was scored is in --output; run the command again to go on", flush=True)
        wait_s = 0.0
    evaluator.finish(wait_s)
    return 0


def evaluate_one(path: str, tasks: list, done: set[tuple], args: argparse.Namespace, device: str,
                 table: Table) -> None:
    """The tasks `done` lacks for one checkpoint: scored, appended to --output, printed. A checkpoint with nothing
    left to score is not loaded (nor hashed)."""
    ckpt = identify(path)
    todo = [t for t in tasks if (ckpt.step, ckpt.weights_sha256, t.fingerprint) not in done]
    if len(todo) < len(tasks):
        table.row(ckpt.step, f"({len(tasks) - len(todo)} of {len(tasks)} tasks in {args.output} already: {path})")
    if not todo:
        return
    records = evaluate_checkpoint(path, todo, tokenizer=args.tokenizer, device=device)
    append_records(Path(args.output), records, done)
    for r in records:
        table.row(r["step"], f"{r['task']:<20} {format_scores(r)}")


def local_run_folder(run: str) -> C.RunFolder:
    """--run-dir, which both ways of scoring read on this machine: a remote URI is refused, not opened."""
    if "://" in run:
        raise TaskError(f"--run-dir {run}: only a local run folder can be evaluated (copy it here first)")
    folder = C.RunFolder(run)
    if not folder.local.is_dir():
        raise TaskError(f"--run-dir {run}: no such folder")
    return folder


def run_checkpoints(run: str) -> list[str]:
    """The checkpoint folders of a local run folder, oldest first (each is verified when it is loaded)."""
    folder = local_run_folder(run)
    names = folder.checkpoints()
    if not names:
        raise TaskError(f"--run-dir {run} holds no checkpoint (checkpoint_XXXXXXXX folders)")
    return [str(folder.local / name) for name in names]


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.device(device)
    except RuntimeError:
        raise TaskError(f"--device {device}: not a torch device (auto, cpu, cuda, cuda:N)") from None
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise TaskError(f"--device {device}: no CUDA device here")
    return device


class Table:
    """The console table; its header comes with the first row (an error before any result prints no table)."""

    started = False

    def row(self, step: int | None, text: str) -> None:
        if not self.started:
            print(f"{'step':>8}  {'task':<20} metrics")
            self.started = True
        print(f"{'-' if step is None else step:>8}  {text}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
