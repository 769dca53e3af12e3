"""What a person sees on the console of a run: the lines workers tag with `say`, without Ray's prefix; every other
line Ray streams to the driver goes to a log file the start line names."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

TAG = "[minilm] "
# Raylet messages that need nothing from the user (read tasks start worker processes Ray did not expect).
ROUTINE_RAYLET = ("PYTHON worker processes have been started",)


def say(message: str) -> None:
    """A worker's line for a person, to the real stdout, since Ray Train's print patch would show print() twice."""
    for line in str(message).splitlines() or [""]:
        print(TAG + line, file=sys.__stdout__, flush=True)


def is_routine(data: dict) -> bool:
    return data.get("pid") == "raylet" and any(r in line for line in data.get("lines", []) for r in ROUTINE_RAYLET)


class ConsoleFilter:
    """Replaces Ray's printing of worker output in this driver (`ray_print_logs`) while installed."""

    def __init__(self, log_path: Path):
        self.log_path = Path(log_path)
        self._lock = threading.Lock()
        self.installed = False

    def install(self) -> bool:
        """Route worker output through `handle`; False (and Ray prints as usual) if Ray's internals moved."""
        from .ray_compat import route_worker_output

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.installed = route_worker_output(self.handle, self.take_raylet)
        return self.installed

    def take_raylet(self, data: dict) -> bool:
        """Routine raylet messages go to the file; the rest (a worker killed for memory, ...) to the console."""
        if not is_routine(data):
            return False
        self.append([f"(raylet) {line}" for line in data.get("lines", [])])
        return True

    def append(self, lines: list[str]) -> None:
        with self._lock, open(self.log_path, "a") as f:
            f.write("\n".join(lines) + "\n")

    def handle(self, data: dict) -> None:
        ours, theirs = [], []
        origin = data.get("actor_name") or data.get("task_name") or ""
        prefix = f"({origin} pid={data.get('pid')}) " if data.get("pid") not in ("raylet", "autoscaler") else \
            f"({data.get('pid')}) "
        for line in data.get("lines", []):
            if line.startswith(TAG):
                ours.append(line[len(TAG):])
            else:
                theirs.append(prefix + line)
        if theirs:
            self.append(theirs)
        with self._lock:
            for line in ours:
                print(line, file=sys.stdout, flush=True)
