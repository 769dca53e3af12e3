"""The eval log (RUN/eval.jsonl, or `ray_jobs.evaluate --output`): its records read and appended, and handed on as
the run's metrics.

The evaluator (`ray_jobs.evaluator`, in the driver) appends one record per (checkpoint, task) to RUN/eval.jsonl, the
records of `ray_jobs.evaluate`. Rank 0 reads what is new at each log step (`EvalInbox.poll`) and hands each record
on, once, as `eval/<task>/<metric>` at the checkpoint's step: to metrics.jsonl, the trackers and Ray's report. It
never waits for a score, except for those of the last checkpoint after the last step (`EvalInbox.wait_for`).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from .errors import UsageError
from .jsonl import append_jsonl, read_jsonl

EVAL_LOG = "eval.jsonl"  # in the run folder
PREFIX = "eval/"


def eval_metrics(record: dict) -> dict[str, float]:
    """A record's finite numeric metrics as {"eval/<task>/<metric>": value} (a generate task's are counts: none)."""
    if record.get("kind") == "generate" or "error" in record:
        return {}
    return {f"{PREFIX}{record['task']}/{k}": float(v) for k, v in (record.get("metrics") or {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def read_records(path: Path, offset: int = 0) -> tuple[list[dict], int]:
    """The records of `path` after byte `offset` (a line that is not one is passed over: the file is the evaluator's),
    and the offset after the last whole line: a line still being written is read next time."""
    return read_jsonl(path, offset, live=True, record=lambda r: r if isinstance(r, dict) and isinstance(
        r.get("task"), str) and isinstance(r.get("step"), int) else None)


def scored_keys(path: Path) -> set[tuple]:
    """The (step, weights SHA-256, task fingerprint) of every score in `path`; a scoring that failed (an `error`
    record) is tried again. A line that is not a record of `ray_jobs.evaluate` is a UsageError."""
    def score_key(r) -> tuple | None:
        key = None if "error" in r else (r["step"], r["weights_sha256"], r["fingerprint"])
        hash(key)  # an unhashable value (TypeError) makes no record either
        return key

    def refuse(n: int) -> None:
        raise UsageError(f"{path}:{n}: not a record of ray_jobs.evaluate (choose another --output)")

    return set(read_jsonl(path, record=score_key, bad_line=refuse)[0])


def append_records(path: Path, records: list[dict], done: set[tuple]) -> None:
    """One line per record, as each checkpoint finishes (an interrupted evaluation keeps what it scored); the scores
    join `done`, the set `scored_keys` read."""
    append_jsonl(path, records, ensure_ascii=False)
    done.update((r["step"], r["weights_sha256"], r["fingerprint"]) for r in records if "error" not in r)


def scored_checkpoints(run_dir: str | os.PathLike) -> set[str]:
    """The checkpoint folders RUN/eval.jsonl holds a score of (a failed scoring is no score: it is tried again)."""
    return {Path(str(r.get("checkpoint", ""))).name for r in read_records(Path(run_dir) / EVAL_LOG)[0]
            if "error" not in r}


class EvalInbox:
    """Rank 0's reader of RUN/eval.jsonl. `forwarded` holds the (step, task) pairs metrics.jsonl has already (read from
    it at start, so a restarted worker or a resubmitted driver forwards each record once)."""

    def __init__(self, run_dir: str | os.PathLike, tasks: list[str], metrics_records: list[dict]):
        self.path, self.tasks, self.offset = Path(run_dir) / EVAL_LOG, list(tasks), 0
        self.forwarded = {(r["optimizer_step"], r["eval_task"]) for r in metrics_records if "eval_task" in r}
        self.seen: set[tuple[int, str]] = set()  # every (step, task) read so far: a score or an error
        self.waiting: dict[tuple[int, str], dict] = {}  # scores read and not forwarded yet
        self.latest: dict[str, float] = {}  # the newest checkpoint's scores, for Ray's report (Tune, dashboard)
        self.latest_step, self._size = -1, -1

    def poll(self, step: int) -> list[dict]:
        """The scores not yet forwarded, of checkpoints at or before `step` (a later one is of steps about to be
        redone after a restart), as metrics.jsonl records: {"optimizer_step", "eval_task", "eval/<task>/...": v}."""
        size = self.path.stat().st_size if self.path.exists() else 0
        if size != self._size:
            self._size = size
            records, self.offset = read_records(self.path, self.offset)
            for r in records:
                key = (r["step"], r["task"])
                self.seen.add(key)
                if key not in self.forwarded and eval_metrics(r):  # a later score of a key replaces an earlier one
                    self.waiting[key] = r
        out = []
        for key in sorted(k for k in self.waiting if k[0] <= step):
            metrics = eval_metrics(self.waiting.pop(key))
            self.forwarded.add(key)
            out.append({"optimizer_step": key[0], "eval_task": key[1], **metrics})
            if key[0] >= self.latest_step:
                self.latest_step = key[0]
                self.latest.update(metrics)
        return out

    def scored(self, steps: int | list[int]) -> bool:
        """Every task has a record (a score or an error) for the checkpoint(s) at `steps`."""
        steps = [steps] if isinstance(steps, int) else steps
        return all((step, task) in self.seen for step in steps for task in self.tasks)

    def wait_for(self, steps: int | list[int], timeout_s: float, poll_s: float = 1.0) -> list[dict]:
        """After the last step: wait up to `timeout_s` for the scores of the checkpoint(s) at `steps`; what arrived."""
        last = steps if isinstance(steps, int) else max(steps)
        deadline, out = time.monotonic() + timeout_s, []
        while True:
            out += self.poll(last)
            if self.scored(steps) or time.monotonic() >= deadline:
                return out
            time.sleep(poll_s)


__all__ = ["EVAL_LOG", "EvalInbox", "append_records", "eval_metrics", "read_records", "scored_checkpoints",
           "scored_keys"]
