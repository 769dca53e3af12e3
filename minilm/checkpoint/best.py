"""The run's best checkpoint by one eval metric (`best.json`), and the checkpoints pruning must leave alone
(`eval-pending.json`), both changed only under the run folder's `eval.lock`. An evaluator pins a checkpoint before
scoring it and unpins it after `update_best`; `pinned` reads the pins first, so a score between its reads is seen."""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import time
from pathlib import Path

from ..errors import UsageError
from ..eval_log import EVAL_LOG, read_records
from ..fsio import loads, node_lock
from .files import MARKER, CheckpointError, parse_marker
from .resume import CHECKPOINT_NAME, LEASE, RunFolder

BEST = "best.json"
PENDING = "eval-pending.json"
EVAL_LOCK = "eval.lock"  # held while best.json or eval-pending.json changes
BEST_NAME = "best"  # the last component of RUN/best, as a --checkpoint or --weights
# Metrics where lower is better; higher is better for accuracies (`acc`, `acc_norm`, any name ending in `acc`).
LOWER_IS_BETTER = frozenset({"bpb", "nats_per_token", "loss", "val_loss", "val_bpb"})


class MetricError(UsageError, ValueError):
    """A metric that cannot choose a best checkpoint (its name says neither "higher" nor "lower is better")."""


def canonical(metric: str) -> tuple[str, str]:
    """(`eval/<task>/<metric>`, "min" or "max") for `eval/<task>/<metric>` or `<task>/<metric>`."""
    parts = str(metric).split("/")
    if len(parts) > 2 and parts[0] == "eval":
        parts = parts[1:]
    task, name = "/".join(parts[:-1]), parts[-1]
    if name in LOWER_IS_BETTER:
        mode = "min"
    elif name.endswith("acc") or name == "acc_norm":
        mode = "max"
    else:
        raise MetricError(f"metric {metric!r} cannot choose the best checkpoint: name it eval/<task>/<metric> with "
                          f"a metric of {', '.join(sorted(LOWER_IS_BETTER))} (lower is better) or acc, acc_norm, "
                          f"*acc (higher is better)")
    if not task:
        raise MetricError(f"metric {metric!r}: name it eval/<task>/<metric> (or <task>/<metric>), e.g. eval/held/bpb")
    return f"eval/{task}/{name}", mode


def read_best(folder: RunFolder) -> dict | None:
    """best.json (None when there is none); a damaged one is one CheckpointError line naming it."""
    raw = folder.read(BEST)
    if raw is None:
        return None
    where = f"{folder.display}/{BEST}"
    try:
        best = loads(raw)
    except ValueError as e:
        raise CheckpointError(f"{where} is unreadable ({e}): fix or delete it (the next evaluation writes it "
                              f"again)") from None
    fields = {"checkpoint": (str, "a string"), "step": (int, "an integer"), "metric": (str, "a string"),
              "mode": (str, "a string"), "value": ((int, float), "a number"), "weights_sha256": (str, "a string"),
              "time": (str, "a string")}
    if not isinstance(best, dict):
        raise CheckpointError(f"{where} is not a mapping of {', '.join(fields)}: fix or delete it")
    for key, (kind, what) in fields.items():
        if not isinstance(best.get(key), kind) or isinstance(best[key], bool):
            got = repr(best[key])[:80] if key in best else "nothing"
            raise CheckpointError(f"{where}: {key} must be {what}, got {got} (edited, or not written by minilm): "
                                  f"fix or delete it")
    # the name becomes a path: only a checkpoint folder of the run, never '..' or a '/'
    if not CHECKPOINT_NAME.fullmatch(best["checkpoint"]):
        raise CheckpointError(f"{where}: checkpoint {best['checkpoint'][:80]!r} is not a checkpoint_XXXXXXXX folder "
                              f"name: fix or delete it")
    try:
        metric, mode = canonical(best["metric"])
    except MetricError as e:
        raise CheckpointError(f"{where}: {e}") from None
    if (metric, mode) != (best["metric"], best["mode"]) or not math.isfinite(best["value"]):
        raise CheckpointError(f"{where}: metric {best['metric']!r}, mode {best['mode']!r} and value "
                              f"{best['value']!r} do not agree (edited, or not written by minilm): fix or delete it")
    return best


def update_best(folder: RunFolder, metric: str, checkpoint: str, step: int, value: float,
                weights_sha256: str) -> bool:
    """Make `checkpoint` (scored a finite `value` on `metric`) the best if there is none yet, if best.json holds
    another metric, if the folder no longer holds the best's weights, or if `value` is strictly better. Whether
    best.json changed."""
    metric, mode = canonical(metric)
    if not math.isfinite(value):
        return False
    with eval_lock(folder):  # two evaluators never both compare against the same old best
        best = read_best(folder)
        if best is not None and best["metric"] == metric and holds(folder, best):
            if not (value < best["value"] if mode == "min" else value > best["value"]):
                return False
        record = {"checkpoint": checkpoint, "step": int(step), "metric": metric, "mode": mode, "value": float(value),
                  "weights_sha256": weights_sha256, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        folder.write(BEST, json.dumps(record, indent=2, sort_keys=True).encode())
    return True


def eval_lock(folder: RunFolder):
    """The run folder's evaluation lock (local and shared storage: evaluation reads checkpoints from a file system)."""
    return node_lock(folder.local / EVAL_LOCK) if folder.local is not None else contextlib.nullcontext()


def holds(folder: RunFolder, best: dict) -> bool:
    """Does the run folder still hold the weights best.json scored (neither moved aside nor replaced)?"""
    return weights_sha256(folder, best["checkpoint"]) == best["weights_sha256"]


def weights_sha256(folder: RunFolder, name: str) -> str | None:
    """The weights SHA-256 checkpoint `name`'s marker vouches for (None without a readable one): what every score
    and pin is keyed by, so that an abandoned branch's checkpoint of the same name is never taken for it."""
    try:
        return parse_marker(folder.read(f"{name}/{MARKER}"), name)["model.safetensors"]
    except CheckpointError:
        return None


def held_weights(folder: RunFolder) -> dict[str, str]:
    """{checkpoint name: weights SHA-256} of the run folder's checkpoints with a marker: the run's own branch."""
    return {n: sha for n in folder.checkpoints() if (sha := weights_sha256(folder, n))}


def scored_checkpoints(folder: RunFolder) -> set[str]:
    """The run folder's checkpoints eval.jsonl holds a score of (not an error), for the weights each holds now."""
    scores = {(Path(str(r.get("checkpoint", ""))).name, r.get("weights_sha256"))
              for r in read_records(folder.local / EVAL_LOG)[0] if "error" not in r}
    return {n for n, sha in held_weights(folder).items() if (n, sha) in scores}


def owner() -> str:
    """This evaluator's key in eval-pending.json."""
    return f"{socket.gethostname()}-{os.getpid()}"


def write_pending(folder: RunFolder, names: list[str], scored: tuple[str, ...] = ()) -> None:
    """This evaluator's checkpoints queued for evaluation, each with its weights (replacing its earlier list, never
    another evaluator's); `scored` leave every list, as does an entry whose folder now holds other weights."""
    with eval_lock(folder):
        held = held_weights(folder)
        owners = {**_pending_owners(folder), owner(): {n: held.get(n) for n in names}}
        done = {(n, held.get(n)) for n in scored}
        owners = {o: {n: sha for n, sha in e.items() if (n, sha) not in done and (sha is None or held.get(n, sha) == sha)}
                  for o, e in owners.items()}
        owners = {o: e for o, e in owners.items() if e}
        union = sorted(set().union(*owners.values()))
        folder.write(PENDING, json.dumps({"checkpoints": union, "owners": owners}, indent=2, sort_keys=True).encode())


def _pending_owners(folder: RunFolder) -> dict[str, dict[str, str | None]]:
    """eval-pending.json's entries by evaluator, {name: weights SHA-256}; a missing or damaged file is none (it only
    pins, it chooses nothing); a list of an older minilm (names alone) has no hash: its entries pin by name."""
    try:
        pending = loads(folder.read(PENDING) or b"null")
        owners = pending.get("owners", {"": pending["checkpoints"]})
    except (ValueError, TypeError, KeyError, AttributeError):
        return {}
    if not isinstance(owners, dict):
        return {}
    entries = {o: e if isinstance(e, dict) else dict.fromkeys(n for n in e if isinstance(n, str))
               for o, e in owners.items() if isinstance(e, (dict, list))}
    return {str(o): {n: sha for n, sha in e.items() if isinstance(n, str) and CHECKPOINT_NAME.fullmatch(n)
                     and (sha is None or isinstance(sha, str))} for o, e in entries.items()}


def read_pending(folder: RunFolder) -> set[str]:
    """The checkpoints queued for evaluation, by any evaluator, that still hold the weights they were queued for."""
    held = held_weights(folder)
    return {n for e in _pending_owners(folder).values() for n, sha in e.items() if sha is None or held.get(n) == sha}


def pinned(folder: RunFolder) -> set[str]:
    """The checkpoints pruning keeps whatever --keep-checkpoints says: the best one and those pending evaluation.
    A damaged best.json raises (pruning then deletes nothing rather than guess)."""
    pending = read_pending(folder)  # first: the evaluator unpins only after it wrote best.json
    best = read_best(folder)
    return pending | ({best["checkpoint"]} if best and holds(folder, best) else set())


def resolve(path: str) -> str:
    """RUN/best -> RUN/<the checkpoint best.json names> (local run folders); any other path (or a real folder named
    best) as it is. A run folder without best.json, or whose best is gone or replaced, is a CheckpointError."""
    where = Path(path)
    if where.name != BEST_NAME or where.is_dir():
        return path
    folder = RunFolder(where.parent)
    best = read_best(folder)
    if best is None:
        if folder.local.is_dir() and (folder.checkpoints() or LEASE in folder.names()
                                      or (folder.local / "metrics.jsonl").is_file()):
            raise CheckpointError(f"{where.parent} has no best checkpoint yet ({BEST}): it is written when a run "
                                  f"evaluates its checkpoints (ray_jobs.pretrain --eval-tasks ...)")
        return path  # not a run folder: the caller's "does not exist"
    chosen = where.parent / best["checkpoint"]
    if not chosen.is_dir():
        raise CheckpointError(f"{where.parent}/{BEST} names {best['checkpoint']} (step {best['step']}, "
                              f"{best['metric']} {best['value']:.6g}), which no longer exists")
    if not holds(folder, best):
        raise CheckpointError(f"{where.parent}/{BEST} names {best['checkpoint']}, but that folder no longer holds "
                              f"the weights it scored (weights SHA-256 {best['weights_sha256'][:12]}): it was "
                              f"replaced, or is incomplete")
    return str(chosen)


__all__ = ["BEST", "PENDING", "MetricError", "canonical", "held_weights", "pinned", "read_best",
           "read_pending", "resolve", "scored_checkpoints", "update_best", "weights_sha256", "write_pending"]
