"""The eval log (RUN/eval.jsonl): one record per (checkpoint, task). Rank 0 hands each score on once, as
`eval/<task>/<metric>` at its checkpoint's step; scores are keyed by the weights SHA-256, never by step alone."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from .errors import UsageError
from .fsio import append_jsonl, read_jsonl

EVAL_LOG = "eval.jsonl"  # in the run folder


def eval_metrics(record: dict) -> dict[str, float]:
    """A record's finite numeric metrics as {"eval/<task>/<metric>": value} (a generate task's are counts: none)."""
    metrics = record.get("metrics")
    if record.get("kind") == "generate" or "error" in record or not isinstance(metrics, dict):
        return {}
    return {f"eval/{record['task']}/{k}": float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def read_records(path: Path, offset: int = 0) -> tuple[list[dict], int]:
    """The records of `path` after byte `offset` (a line that is not one is passed over: the file is the evaluator's),
    and the offset after the last whole line: a line still being written is read next time."""
    return read_jsonl(path, offset, live=True, record=lambda r: r if isinstance(r, dict) and isinstance(
        r.get("task"), str) and type(r.get("step")) is int and isinstance(r.get("weights_sha256", ""), str) else None)


def scored_keys(path: Path) -> set[tuple]:
    """The (step, weights SHA-256, task fingerprint) of every score in `path` (an `error` record is no score); a line
    that is not a record of `ray_jobs.evaluate` is a UsageError, a torn last line is passed over."""
    def score_key(r) -> tuple | None:
        key = None if "error" in r else (r["step"], r.get("weights_sha256"), r["fingerprint"])
        hash(key)  # an unhashable value (TypeError) makes no record either
        return key

    def refuse(n: int) -> None:
        raise UsageError(f"{path}:{n}: not a record of ray_jobs.evaluate (choose another --output)")

    return set(read_jsonl(path, live=True, record=score_key, bad_line=refuse)[0])


def append_records(path: Path, records: list[dict], done: set[tuple]) -> None:
    """One line per record (an interrupted evaluation keeps what it scored); the scores join `done` (`scored_keys`)."""
    append_jsonl(path, records, ensure_ascii=False)
    done.update((r["step"], r["weights_sha256"], r["fingerprint"]) for r in records if "error" not in r)


class EvalInbox:
    """Rank 0's reader of RUN/eval.jsonl: a score is forwarded only for weights of the run's own checkpoints
    (`weights()`: {name: weights SHA-256}), and once (`forwarded`, read from metrics.jsonl at the start)."""

    def __init__(self, run_dir: str | os.PathLike, tasks: list[str], metrics_records: list[dict],
                 weights: Callable[[], dict[str, str]] = dict):
        self.path, self.tasks, self.offset, self.weights = Path(run_dir) / EVAL_LOG, list(tasks), 0, weights
        self.forwarded = {(r["optimizer_step"], r["eval_task"], r.get("weights_sha256")) for r in metrics_records
                          if "eval_task" in r}
        self.own: set[tuple[int, str]] = set()  # (step, weights SHA-256) of this branch's checkpoints seen so far
        self.seen: set[tuple[int, str, str]] = set()  # every (step, task, weights) read so far: a score or an error
        self.waiting: dict[tuple[int, str, str], dict] = {}  # this branch's scores read and not forwarded yet
        self.latest: dict[str, float] = {}  # the newest checkpoint's scores, for Ray's report (Tune, dashboard)
        self.latest_step, self._size = -1, -1

    def look(self) -> None:
        """Note the weights of the run folder's checkpoints (kept: a checkpoint pruned later stays this run's)."""
        self.own.update((int(n.split("_")[1]), sha) for n, sha in self.weights().items())

    def poll(self, step: int) -> list[dict]:
        """This branch's scores not yet forwarded, of checkpoints at or before `step` (a later one's steps are about to
        be redone), as metrics.jsonl records {"optimizer_step", "eval_task", "weights_sha256", "eval/<task>/...": v}."""
        size = self.path.stat().st_size if self.path.exists() else 0
        if size != self._size:
            self._size = size
            records, self.offset = read_records(self.path, self.offset)
            self.look()  # after the read: a score's checkpoint is in the folder before its record is written
            for r in records:
                key = (r["step"], r["task"], r.get("weights_sha256"))
                self.seen.add(key)
                # an older metrics.jsonl's forwarded record, without weights, is of the same branch (it is truncated to
                # the steps this run continues)
                if (key[0], key[2]) in self.own and not {key, key[:2] + (None,)} & self.forwarded and eval_metrics(r):
                    self.waiting[key] = r  # a later score of a key replaces an earlier one
        out = []
        for key in sorted(k for k in self.waiting if k[0] <= step):
            metrics = eval_metrics(self.waiting.pop(key))
            self.forwarded.add(key)
            out.append({"optimizer_step": key[0], "eval_task": key[1], "weights_sha256": key[2], **metrics})
            if key[0] >= self.latest_step:
                self.latest_step = key[0]
                self.latest.update(metrics)
        return out

    def scored(self, steps: list[int]) -> bool:
        """Every task has a record (a score or an error) for this branch's checkpoint(s) at `steps`."""
        self.look()
        return all(any((step, task, sha) in self.seen for s, sha in self.own if s == step)
                   for step in steps for task in self.tasks)

    def wait_for(self, steps: list[int], timeout_s: float, poll_s: float = 1.0) -> list[dict]:
        """After the last step: wait up to `timeout_s` for the scores of the checkpoint(s) at `steps`; what arrived."""
        deadline, out = time.monotonic() + timeout_s, []
        while True:
            out += self.poll(max(steps))
            if self.scored(steps) or time.monotonic() >= deadline:
                return out
            time.sleep(poll_s)

