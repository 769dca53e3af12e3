"""What the loop does after each optimizer step: log, evaluate, checkpoint, stop. The decision is the same on
every rank because the flags it rests on are agreed by all of them (`minilm.distributed.FlagAgreement`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .distributed import FlagAgreement

SIGTERM, DRAIN, TIME_UP, NONFINITE = "SIGTERM", "node drain", "time limit", "non-finite steps"
CHECKPOINT_FAILED, CHECKPOINT_DUE, EXIT_STEPS = "checkpoint write failed", "checkpoint due", "exit after steps"
STOPS = (SIGTERM, DRAIN, TIME_UP)  # a checkpoint at the step every rank agrees on, then an exit
PREEMPTIONS = (SIGTERM, DRAIN)  # ... for a restart
FLAGS = (*STOPS, CHECKPOINT_FAILED, CHECKPOINT_DUE, NONFINITE)


@dataclass(frozen=True)
class Decision:
    log: bool = False
    evaluate: bool = False
    checkpoint: bool = False
    final: bool = False  # the run's last checkpoint: complete before the loop goes on
    stop: str | None = None  # why the run ends after this step (a STOPS reason or EXIT_STEPS)

    @property
    def preempt(self) -> bool:
        return self.stop in PREEMPTIONS


class LoopPolicy:
    """Turns each step's signals (`stop_flags() -> (SIGTERM, drain)`, `nonfinite()`, the checkpoints' cadence and
    `failed()`) into a `Decision`, and raises on every rank at the same step. --exit-after-minutes counts from
    `started_at` (the entry point's start), so a restarted worker group keeps the job's deadline."""

    def __init__(self, collectives, checkpoints, *, total_steps: int, log_every: int, eval_every: int | None,
                 stop_flags, nonfinite, on_nonfinite, exit_after_steps: int | None = None,
                 exit_after_minutes: float | None = None, started_at: float | None = None, clock=time.time):
        self.agreement = FlagAgreement(collectives, FLAGS)
        self.checkpoints, self.cadence = checkpoints, checkpoints.cadence
        self.total_steps, self.log_every, self.eval_every, self.exit_after_steps = \
            total_steps, log_every, eval_every, exit_after_steps
        self.stop_flags, self.nonfinite, self.on_nonfinite, self.clock = stop_flags, nonfinite, on_nonfinite, clock
        start = clock() if started_at is None else started_at
        self.deadline = start + 60 * exit_after_minutes if exit_after_minutes else None

    def after_step(self, step: int) -> Decision:
        time_up = self.deadline is not None and self.clock() > self.deadline
        reasons = self.agreement.push(step, [*self.stop_flags(), time_up, self.checkpoints.failed(),
                                             self.cadence.time_due()], [self.nonfinite()])
        if NONFINITE in reasons:
            self.on_nonfinite()
        if CHECKPOINT_FAILED in reasons:
            self.checkpoints.raise_failure(step)
        exit_now = self.exit_after_steps is not None and step >= self.exit_after_steps
        stop = next((r for r in STOPS if r in reasons), EXIT_STEPS if exit_now else None)
        final = stop is not None or step == self.total_steps
        checkpoint = self.cadence.due(step, final, CHECKPOINT_DUE in reasons, self.agreement.delay)
        evaluate = self.eval_every is not None and (step % self.eval_every == 0 or step == self.total_steps)
        return Decision(log=checkpoint or evaluate or step % self.log_every == 0, evaluate=evaluate,
                        checkpoint=checkpoint, final=final, stop=stop)

    def close(self) -> None:
        """No all-reduce of ours is left in flight when the process group goes away."""
        self.agreement.drain()
