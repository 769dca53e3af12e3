"""The world-size timeline of a run and the work lost at each restart (`world_size.csv` in the run folder): one row
per (re)start of the worker group, its event and the steps redone since its checkpoint (docs/elastic.md)."""

from __future__ import annotations

import contextlib
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
                # a row torn by a killed process lacks its last fields (None): int(None) passes it over
                with contextlib.suppress(KeyError, TypeError, ValueError):
                    rows.append({name: kind(r[name]) for name, kind in FIELDS.items()})
            return rows

    def step_done(self, optimizer_step: int) -> None:
        """Called by rank 0 at every log step: a few bytes."""
        self.last_step_path.write_text(str(optimizer_step))

    def record_start(self, optimizer_step: int, world_size: int, accumulation_steps: int, resumed: bool) -> dict:
        """Append the row for a (re)start of the worker group at `optimizer_step`; return it."""
        previous = self.rows()
        was = previous[-1]["world_size"] if resumed and previous else world_size
        event = "grow" if world_size > was else "shrink" if world_size < was else "restart" if resumed else "start"
        try:  # the steps the previous group completed past this checkpoint
            redone = max(0, int(self.last_step_path.read_text()) - optimizer_step) if resumed else 0
        except (OSError, ValueError):
            redone = 0
        return self.record(optimizer_step, world_size, accumulation_steps, event, redone)

    def redone_steps_total(self) -> int:
        return sum(r["redone_steps"] for r in self.rows())

    def record(self, optimizer_step: int, world_size: int, accumulation_steps: int, event: str,
               redone_steps: int = 0) -> dict:
        row = {"time": round(time.time(), 3), "optimizer_step": optimizer_step, "world_size": world_size,
               "accumulation_steps": accumulation_steps, "event": event, "redone_steps": redone_steps}
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
