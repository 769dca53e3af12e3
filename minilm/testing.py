"""Fault injection for the test suite, off unless a test switches it on: `Trainer(hooks=...)`, or `MINILM_TEST_*`
under `MINILM_TESTING=1` (announced). The step hooks wrap the trainer's stream and step; the loop never calls one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .fsio import write_atomic

SWITCH = "MINILM_TESTING"
PREFIX = "MINILM_TEST_"


@dataclass(frozen=True)
class FaultHooks:
    step_delay_s: float = 0.0  # sleep after every optimizer step (gives a test time to act mid-run)
    hold_file: str | None = None  # while this file exists, every rank waits after its step
    nan_at_steps: tuple[int, ...] = ()  # these optimizer steps get NaN gradients on every rank
    disk_full_at_step: int | None = None  # the checkpoint of this step fails with ENOSPC before optimizer.pt
    checkpoint_delay_s: float = 0.0  # the checkpoint writer sleeps before its marker ...
    checkpoint_delay_step: int | None = None  # ... only at this step (None: every checkpoint)
    checkpoint_paused_file: str | None = None  # ... and first writes the folder it pauses in here
    record_sample_ids: str | None = None  # each rank appends the sample ids of every step to DIR/rank<r>.jsonl

    def active(self) -> dict:
        """The hooks that are on, by name (what the driver announces)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) not in (None, 0, 0.0, (), False)}

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.active().items()}

    @classmethod
    def from_dict(cls, d: dict | None) -> FaultHooks | None:
        if not d:
            return None
        return cls(**{k: tuple(v) if k == "nan_at_steps" else v for k, v in d.items()})

    def install(self, trainer) -> None:
        """Wrap the trainer's stream and optimizer step with the step hooks that are on (none: nothing changes)."""
        if not (self.record_sample_ids or self.step_delay_s or self.hold_file or self.nan_at_steps):
            return
        stream, step_fn = _RememberIds(trainer.batches), trainer.optimizer_step

        def hooked_step(*args, **kwargs):
            step = trainer.step + 1
            with self.nonfinite_gradients(step, trainer.raw_model):
                m = step_fn(*args, **kwargs)
            self.after_step(step, trainer.rank, trainer.world_size, stream.ids)
            return m

        trainer.batches, trainer.optimizer_step = stream, hooked_step

    def after_step(self, step: int, rank: int, world_size: int, sample_ids) -> None:
        if self.record_sample_ids:
            with open(Path(self.record_sample_ids) / f"rank{rank}.jsonl", "a") as f:
                f.write(json.dumps({"optimizer_step": step, "rank": rank, "world_size": world_size, "time": time.time(),
                                    "sample_ids": [int(i) for i in sample_ids]}) + "\n")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if self.hold_file and os.path.exists(self.hold_file):
            write_atomic(f"{self.hold_file}.rank{rank}", str(step))  # where this rank is held; never read half-written
            while os.path.exists(self.hold_file):
                time.sleep(0.05)

    @contextlib.contextmanager
    def nonfinite_gradients(self, step: int, model):
        """NaN gradients for optimizer step `step` (1-based), on every rank."""
        if step not in self.nan_at_steps:
            yield
            return
        handle = model.lm_head.weight.register_hook(lambda grad: grad * float("nan"))
        try:
            yield
        finally:
            handle.remove()

    def before_checkpoint_file(self, step: int | None, name: str) -> None:
        if self.disk_full_at_step is not None and step == self.disk_full_at_step and name == "optimizer.pt":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def before_marker(self, path: Path, step: int | None) -> None:
        if self.checkpoint_delay_s <= 0 or (self.checkpoint_delay_step is not None and step != self.checkpoint_delay_step):
            return
        if self.checkpoint_paused_file:
            write_atomic(self.checkpoint_paused_file, str(path))
        time.sleep(self.checkpoint_delay_s)


class _RememberIds:
    """A stream that keeps the sample ids of the step it last yielded (for `record_sample_ids`)."""

    def __init__(self, stream):
        self.stream, self.ids = stream, None

    @property
    def data_wait_s(self) -> float:
        return self.stream.data_wait_s

    def __iter__(self):
        for micro_batches, ids in self.stream:
            self.ids = ids
            yield micro_batches, ids


_ENV = {  # MINILM_TEST_<NAME> -> (field, parse)
    "STEP_DELAY_S": ("step_delay_s", float),
    "HOLD_FILE": ("hold_file", str),
    "NAN_AT_STEPS": ("nan_at_steps", lambda v: tuple(int(x) for x in v.split(",") if x.strip())),
    "DISK_FULL_AT_STEP": ("disk_full_at_step", int),
    "CHECKPOINT_DELAY_S": ("checkpoint_delay_s", float),
    "CHECKPOINT_DELAY_STEP": ("checkpoint_delay_step", int),
    "CHECKPOINT_PAUSED": ("checkpoint_paused_file", str),
    "RECORD_SAMPLE_IDS": ("record_sample_ids", str),
}


def from_env(environ=None, warn=print) -> FaultHooks | None:
    """The driver's reading of MINILM_TEST_*: hooks only under MINILM_TESTING=1, announced on `warn`."""
    environ = os.environ if environ is None else environ
    given = {k: v for k, v in environ.items() if k.startswith(PREFIX) and v != ""}
    if environ.get(SWITCH) != "1":
        if given:
            warn(f"note: ignoring {', '.join(sorted(given))}: fault injection is only for the test suite "
                 f"(it needs {SWITCH}=1)")
        return None
    unknown = sorted(k for k in given if k[len(PREFIX):] not in _ENV)
    if unknown:
        raise ValueError(f"unknown test hook(s) {', '.join(unknown)}; known: "
                         f"{', '.join(PREFIX + k for k in _ENV)}")
    values = {}
    for key, value in given.items():
        name, parse = _ENV[key[len(PREFIX):]]
        values[name] = parse(value)
    hooks = FaultHooks(**values)
    active = hooks.active()
    if active:
        warn(f"warning: {SWITCH}=1: fault injection is ON for this run: "
             + ", ".join(f"{k}={v}" for k, v in active.items()))
    return hooks if active else None
