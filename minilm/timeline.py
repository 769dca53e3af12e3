"""The world-size timeline of a run and the work lost at each restart (`world_size.csv`).

An elastic run (Ray Train's `--num-workers MIN-MAX`, or torchrun's restarts) is resized by restarting
the worker group from the latest checkpoint. Every (re)start of the group is one row of
`world_size.csv` in the run folder, written by rank 0:

    time,optimizer_step,world_size,accumulation_steps,event,redone_steps

`event` is start (a fresh run), restart (same world size: a failure, or a new job continuing the
run), shrink or grow (the world size changed), preempt (SIGTERM: a checkpoint was written at the
step boundary before exit) or finish. `redone_steps` is the lost work of that restart: the
optimizer steps the previous worker group had completed past the checkpoint it resumed from,
known because rank 0 keeps the last completed step in `last_optimizer_step` next to the CSV. That file
is written at every log step (not every step: it may sit on a network filesystem), so a worker group
that dies abruptly is counted up to its last log step.
"""

from __future__ import annotations

import csv
import time
from pathlib import Path

FIELDS = {"time": float, "optimizer_step": int, "world_size": int, "accumulation_steps": int, "event": str,
          "redone_steps": int}  # the columns, each with its type
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
                try:  # a row torn by a killed process lacks its last fields (None): int(None) passes it over
                    rows.append({name: kind(r[name]) for name, kind in FIELDS.items()})
                except (KeyError, TypeError, ValueError):
                    continue
            return rows

    def last_completed_step(self) -> int | None:
        try:
            return int(self.last_step_path.read_text())
        except (OSError, ValueError):
            return None

    def step_done(self, optimizer_step: int) -> None:
        """Called by rank 0 at every log step: a few bytes."""
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
