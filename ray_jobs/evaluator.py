"""Checkpoints scored beside training (`--eval-tasks`): a driver thread hands each new complete checkpoint to a Ray
task the workers never wait for, into RUN/eval.jsonl and best.json; a failed scoring is one warning."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from minilm import checkpoint as C
from minilm.eval_log import EVAL_LOG, append_records, scored_keys
from minilm.evaluate import evaluate_checkpoint, format_scores, identify
from minilm.safety import redact
from minilm.tasks import Task

from .cli import UsageError

POLL_S = 1.0


# each kind's scores, and the one that chooses the best checkpoint by default (generations have none)
SCORES = {"hellaswag": ("acc", "acc_norm"), "choice": ("acc", "acc_norm"), "bpb": ("bpb", "nats_per_token")}
HEADLINE = {"hellaswag": "acc_norm", "choice": "acc_norm", "bpb": "bpb"}


def check_best_metric(metric: str | None, tasks: list[Task], flag: str = "--eval-best") -> str | None:
    """--eval-best (or tune's --metric): eval/<task>/<metric> of a task in the list; by default the first task's
    headline score."""
    if metric is None:
        return next((f"eval/{t.name}/{HEADLINE[t.kind]}" for t in tasks if t.kind in HEADLINE), None)
    name = metric.removeprefix("eval/")
    task, _, key = name.partition("/")
    if key not in SCORES.get({t.name: t.kind for t in tasks}.get(task), ()):
        choices = [f"eval/{t.name}/{k}" for t in tasks for k in SCORES.get(t.kind, ())]
        raise UsageError(f"{flag} {metric}: not a score of the task list; choose from {', '.join(choices)}")
    return f"eval/{name}"


class Evaluator:
    """The driver's watcher of one local run folder; `start()` before training, `finish()` after it."""

    def __init__(self, run_dir: str | Path, tasks_file: str, tasks: list[Task], resources: dict[str, float],
                 run_name: str, best_metric: str | None, tokenizer: str | None = None, say=None,
                 output: Path | None = None):
        self.folder = C.RunFolder(run_dir)
        self.tasks_file, self.tasks, self.resources = tasks_file, tasks, resources
        self.run_name, self.best_metric, self.tokenizer = run_name, best_metric, tokenizer
        # each line as it happens, also into a pipe or a Ray job's log (print alone would hold them in its buffer)
        self.say = say or (lambda line: print(line, flush=True))
        self.output = output or Path(run_dir) / EVAL_LOG
        self.done = scored_keys(self.output)  # (step, weights SHA-256, fingerprint) of every score in eval.jsonl
        self.seen: set[str] = set()  # checkpoint folders looked at (scored, handed out, or nothing left to score)
        self.running: dict = {}  # ObjectRef -> (checkpoint name, its identity, the tasks it scores)
        self.failed: set[str] = set()  # scoring failed: pinned until a later scoring (pruning keeps them)
        self.scored: set[str] = set()  # scored since the last pin: unpinned for every evaluator
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="minilm-evaluator", daemon=True)
        self._remote = None

    def start(self) -> Evaluator:
        import ray

        # scheduling_strategy="DEFAULT": a Tune trial's placement group (its one 0.1-CPU bundle) would capture the task
        self._remote = ray.remote(score_checkpoint).options(
            num_cpus=self.resources.get("CPU", 0), num_gpus=self.resources.get("GPU", 0), max_retries=0,
            scheduling_strategy="DEFAULT",
            resources={k: v for k, v in self.resources.items() if k not in ("CPU", "GPU")} or None)
        self._tasks_ref = ray.put(self.tasks)
        self._thread.start()
        return self

    def finish(self, wait_s: float) -> None:
        """After training: the checkpoints not yet scored, waited for up to `wait_s`; what is left is said."""
        self._stop.set()
        self._thread.join()
        deadline = time.monotonic() + wait_s
        try:
            self.submit_new()
            while self.running and time.monotonic() < deadline:
                self.collect(timeout=min(POLL_S, max(0.0, deadline - time.monotonic())))
            if self.running:
                import ray

                names = sorted(self.running_names())
                self.say(f"note: {len(names)} checkpoint(s) not scored within {wait_s / 60:g} min "
                         f"({', '.join(names)}); score them later with: python -m ray_jobs.evaluate --run-dir "
                         f"{self.folder.display} --tasks {self.tasks_file} --output {self.output}")
                for ref in self.running:
                    ray.cancel(ref, force=True)
                self.running.clear()  # eval-pending.json still names them: pruning keeps them for a later scoring
        except Exception as e:  # training's outcome stands whatever happens here
            self.say(f"warning: evaluation beside training: {type(e).__name__}: {redact(str(e))}")

    def _watch(self) -> None:
        said = set()
        while not self._stop.is_set():
            try:
                self.submit_new()
                self.collect(timeout=POLL_S)
            except Exception as e:  # the evaluator never stops training; each kind of trouble is said once
                line = f"warning: evaluation beside training: {type(e).__name__}: {redact(str(e))}; retrying"
                if line not in said:
                    said.add(line)
                    self.say(line)
                self._stop.wait(10 * POLL_S)

    def submit_new(self) -> None:
        """Hand each complete checkpoint not seen before to a Ray task (only the tasks eval.jsonl lacks for it); a torn
        one is passed over once a newer one is complete."""
        names = [n for n in self.folder.checkpoints() if n not in self.seen]
        for i, name in enumerate(names):
            try:
                ckpt = identify(self.folder.local / name)
                todo = [t for t in self.tasks if (ckpt.step, ckpt.weights_sha256, t.fingerprint) not in self.done]
                if todo:
                    self.folder.complete(name)  # every file there, hashes matching
            except (C.CheckpointError, OSError) as e:
                if any(self.folder.has_marker(n) for n in names[i + 1:]):
                    self.seen.add(name)
                    self.say(f"note: not scoring {name}: {e}")
                continue
            self.seen.add(name)
            if todo:
                ref = self._remote.remote(str(self.folder.local / name), self._tasks_ref,
                                          [t.fingerprint for t in todo], self.tokenizer, self.run_name)
                self.running[ref] = (name, ckpt, todo)
        self.pin()

    def collect(self, timeout: float) -> None:
        import ray

        if not self.running:
            time.sleep(timeout)
            return
        ready, _ = ray.wait(list(self.running), num_returns=len(self.running), timeout=timeout)
        for ref in ready:
            name, ckpt, todo = self.running.pop(ref)
            try:
                records = ray.get(ref)
            except Exception as e:  # a task error, a lost node: one line, an error record per task
                why = ray_error_line(e)
                self.say(f"warning: scoring {name} failed: {why}; training goes on")
                records = [{"task": t.name, "kind": t.kind, "fingerprint": t.fingerprint, "checkpoint": name,
                            "step": ckpt.step, "weights_sha256": ckpt.weights_sha256, "error": why,
                            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")} for t in todo]
            self.record(name, records)
            if any("error" in r for r in records):
                self.failed.add(name)  # pinned for the next scoring (a resubmit's, or `evaluate --follow`)
            else:
                self.scored.add(name)
        if ready:
            self.pin()

    def record(self, name: str, records: list[dict]) -> None:
        append_records(self.output, records, self.done)
        scores = [r for r in records if "error" not in r]
        if not scores:
            return
        self.say(f"eval  step {scores[0]['step']}: " + "; ".join(
            f"{r['task']} {format_scores(r)}" for r in scores if r["kind"] != "generate"))
        if self.best_metric:
            task, _, key = self.best_metric.removeprefix("eval/").partition("/")
            for r in scores:
                if r["task"] == task and key in r["metrics"] and C.update_best(
                        self.folder, self.best_metric, name, r["step"], r["metrics"][key], r["weights_sha256"]):
                    self.say(f"best  {name} by {self.best_metric} {r['metrics'][key]:.4f} ({C.BEST})")

    def running_names(self) -> set[str]:
        return {name for name, _, _ in self.running.values()}

    def pin(self) -> None:
        """The checkpoints handed out and not scored yet: pruning keeps them (and the best one) until they are."""
        C.write_pending(self.folder, sorted(self.running_names() | self.failed), scored=tuple(self.scored))
        self.scored.clear()


def score_checkpoint(path: str, tasks: list[Task], fingerprints: list[str], tokenizer: str | None,
                     run_name: str) -> list[dict]:
    """The Ray task: the tasks of `fingerprints` on one checkpoint; the scores also to the dashboard."""
    import ray
    import torch

    from . import dashboard_metrics

    torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))
    todo = [t for t in tasks if t.fingerprint in fingerprints]
    records = evaluate_checkpoint(path, todo, tokenizer=tokenizer, device="cuda" if torch.cuda.is_available() else "cpu")
    dashboard_metrics.publish_eval(records, run_name)
    return records


def ray_error_line(e: BaseException) -> str:
    """The task's own exception line out of Ray's wrapper."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {redact(' '.join(str(cause).split()))[:300]}"
    lines = [line for line in str(e).splitlines() if line.strip()]
    return redact(lines[-1].strip() if lines else type(e).__name__)[:300]
