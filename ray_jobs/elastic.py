"""Elastic runs: the world-size timeline, lost work after a restart, and the shared-storage check.

Ray Train resizes an elastic run (`--num-workers MIN-MAX`) by restarting the worker group from
the latest checkpoint. Every (re)start of the group is one row of `world_size.csv` in the run
folder, written by rank 0:

    time,optimizer_step,world_size,accumulation_steps,event,redone_steps

`event` is start (a fresh run), restart (same world size: a failure, or a new job continuing the
run), shrink or grow (the world size changed), preempt (SIGTERM: a checkpoint was written at the
step boundary before exit) or finish. `redone_steps` is the lost work of that restart: the
optimizer steps the previous worker group had completed past the checkpoint it resumed from,
known because rank 0 keeps the last completed step in `last_optimizer_step` next to the CSV.
"""

from __future__ import annotations

import csv
import time
import uuid
from pathlib import Path

FIELDS = ("time", "optimizer_step", "world_size", "accumulation_steps", "event", "redone_steps")
TIMELINE = "world_size.csv"
LAST_STEP = "last_optimizer_step"


class WorldSizeTimeline:
    """world_size.csv plus the last completed optimizer step, in a (shared) run folder."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / TIMELINE
        self.last_step_path = Path(run_dir) / LAST_STEP

    def rows(self) -> list[dict]:
        if not self.path.is_file():
            return []
        with open(self.path, newline="") as f:
            rows = []
            for r in csv.DictReader(f):
                try:
                    rows.append({"time": float(r["time"]), "optimizer_step": int(r["optimizer_step"]),
                                 "world_size": int(r["world_size"]), "accumulation_steps": int(r["accumulation_steps"]),
                                 "event": r["event"], "redone_steps": int(r["redone_steps"])})
                except (KeyError, TypeError, ValueError):
                    continue  # a row torn by a killed process
            return rows

    def last_completed_step(self) -> int | None:
        try:
            return int(self.last_step_path.read_text())
        except (OSError, ValueError):
            return None

    def step_done(self, optimizer_step: int) -> None:
        """Called by rank 0 after every optimizer step: a few bytes, so lost work is known exactly."""
        self.last_step_path.write_text(str(optimizer_step))

    def record_start(self, optimizer_step: int, world_size: int, accumulation_steps: int, resumed: bool) -> dict:
        """Append the row for a (re)start of the worker group at `optimizer_step`; return it."""
        previous = self.rows()
        if not resumed or not previous:
            event = "start" if not resumed else "restart"
        else:
            before = previous[-1]["world_size"]
            event = "grow" if world_size > before else "shrink" if world_size < before else "restart"
        reached = self.last_completed_step()
        redone = max(0, reached - optimizer_step) if resumed and reached is not None else 0
        return self._append(optimizer_step, world_size, accumulation_steps, event, redone)

    def record(self, optimizer_step: int, world_size: int, accumulation_steps: int, event: str) -> dict:
        return self._append(optimizer_step, world_size, accumulation_steps, event, 0)

    def redone_steps_total(self) -> int:
        return sum(r["redone_steps"] for r in self.rows())

    def _append(self, optimizer_step, world_size, accumulation_steps, event, redone) -> dict:
        row = {"time": round(time.time(), 3), "optimizer_step": optimizer_step, "world_size": world_size,
               "accumulation_steps": accumulation_steps, "event": event, "redone_steps": redone}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.is_file()
        with open(self.path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            if new:
                writer.writeheader()
            writer.writerow(row)
        return row


def format_timeline(rows: list[dict]) -> str:
    """The table the run summary prints."""
    if not rows:
        return ""
    t0 = rows[0]["time"]
    lines = [f"{'time':>8} {'step':>6} {'world':>5} {'accum':>5}  {'event':<8} redone"]
    for r in rows:
        lines.append(f"{r['time'] - t0:>7.1f}s {r['optimizer_step']:>6} {r['world_size']:>5} "
                     f"{r['accumulation_steps']:>5}  {r['event']:<8} {r['redone_steps']}")
    return "\n".join(lines)


SHARED_STORAGE_HINT = ("a multi-node run needs a --storage-path every node can read and write: an s3:// or gs:// "
                       "URI, or a shared filesystem mounted at the same path on every node (NFS, EFS, Filestore, "
                       "Lustre, a ReadWriteMany PersistentVolume)")


def nodes_missing_path(storage: Path, hide_on_other_nodes: bool = False) -> list[str]:
    """Addresses of alive Ray nodes that cannot see a marker file written here under `storage`.

    One zero-CPU task per node, pinned to it. `hide_on_other_nodes` is a test hook: it makes every
    node but this one report the marker missing, as it would be with node-local storage.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) <= 1:
        return []
    storage.mkdir(parents=True, exist_ok=True)
    marker = storage / f".minilm-storage-check-{uuid.uuid4().hex}"
    marker.write_text("written by the driver's node")
    here = ray.get_runtime_context().get_node_id()

    @ray.remote(num_cpus=0)
    def sees(path: str, hide: bool) -> bool:
        return not hide and Path(path).is_file()

    try:
        refs = {n["NodeManagerAddress"] + f" ({n['NodeID'][:8]})":
                sees.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(str(marker), hide_on_other_nodes and n["NodeID"] != here)
                for n in nodes}
        results = dict(zip(refs, ray.get(list(refs.values()), timeout=120), strict=True))
    finally:
        marker.unlink(missing_ok=True)
    return sorted(name for name, ok in results.items() if not ok)
