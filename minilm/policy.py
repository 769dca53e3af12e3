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
    """Turns each step's signals into a `Decision`, and raises (`on_nonfinite`, `on_checkpoint_failed`) on every
    rank at the same step. Sources: `stop_flags() -> (SIGTERM, drain)`, `checkpoint_failed() -> bool`,
    `nonfinite() -> 0-dim device tensor`; --checkpoint-every-minutes runs on rank 0's clock (`is_rank0`)."""

    def __init__(self, collectives, *, start_step: int, total_steps: int, checkpoint_every: int, log_every: int,
                 eval_every: int | None, stop_flags, checkpoint_failed, nonfinite, on_nonfinite,
                 on_checkpoint_failed, is_rank0: bool = True, checkpoint_every_minutes: float | None = None,
                 exit_after_steps: int | None = None, exit_after_minutes: float | None = None,
                 clock=time.monotonic):
        self.agreement = FlagAgreement(collectives, FLAGS)
        self.total_steps, self.checkpoint_every, self.log_every = total_steps, checkpoint_every, log_every
        self.eval_every, self.exit_after_steps = eval_every, exit_after_steps
        self.stop_flags, self.checkpoint_failed, self.nonfinite = stop_flags, checkpoint_failed, nonfinite
        self.on_nonfinite, self.on_checkpoint_failed = on_nonfinite, on_checkpoint_failed
        self.due_seconds = 60 * checkpoint_every_minutes if checkpoint_every_minutes and is_rank0 else None
        self.clock = clock
        self.deadline = clock() + 60 * exit_after_minutes if exit_after_minutes else None
        self.last_checkpoint_step, self.checkpoint_clock, self.due_raised = start_step, clock(), False

    def after_step(self, step: int) -> Decision:
        time_up = self.deadline is not None and self.clock() > self.deadline
        reasons = self.agreement.push(step, [*self.stop_flags(), time_up, self.checkpoint_failed(), self._due()],
                                      [self.nonfinite()])
        if NONFINITE in reasons:
            self.on_nonfinite()
        if CHECKPOINT_FAILED in reasons:
            self.on_checkpoint_failed()
        stop = next((r for r in STOPS if r in reasons), EXIT_STEPS if step == self.exit_after_steps else None)
        final = stop is not None or step == self.total_steps
        # a time-based checkpoint raised `delay` steps ago, unless one was written since
        due = CHECKPOINT_DUE in reasons and self.last_checkpoint_step < step - self.agreement.delay
        checkpoint = final or due or step % self.checkpoint_every == 0
        evaluate = self.eval_every is not None and (step % self.eval_every == 0 or step == self.total_steps)
        if checkpoint:
            self.last_checkpoint_step, self.checkpoint_clock, self.due_raised = step, self.clock(), False
        return Decision(log=checkpoint or evaluate or step % self.log_every == 0, evaluate=evaluate,
                        checkpoint=checkpoint, final=final, stop=stop)

    def _due(self) -> bool:
        """--checkpoint-every-minutes have passed since the last checkpoint (raised once until the next one)."""
        if self.due_seconds is None or self.due_raised:
            return False
        self.due_raised = self.clock() - self.checkpoint_clock >= self.due_seconds
        return self.due_raised

    def close(self) -> None:
        """No all-reduce of ours is left in flight when the process group goes away."""
        self.agreement.drain()
