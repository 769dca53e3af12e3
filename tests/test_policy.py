"""`minilm.policy.LoopPolicy`: what the loop does after each step, at world size 1 (the agreement's all-reduce is
the identity; tests/test_nccl_rules.py and the torchrun tests run it on 2 ranks). Pure and fast."""

from __future__ import annotations

import pytest
import torch

from minilm.checkpoint import Cadence
from minilm.distributed import AGREEMENT_DELAY, Collectives
from minilm.policy import DRAIN, EXIT_STEPS, SIGTERM, TIME_UP, LoopPolicy


class Signals:
    def __init__(self):
        self.sigterm = self.drain = self.failed = False
        self.tripped = torch.tensor(False)
        self.now = 0.0


class Raised(Exception):
    pass


class Checkpoints:
    """The checkpoint owner as the policy sees it: its cadence (on the test's clock) and a failed save."""

    def __init__(self, signals: Signals, every: int, minutes: float | None, rank0: bool):
        self.signals, self.cadence = signals, Cadence(every, minutes, rank0, clock=lambda: signals.now)

    def failed(self) -> bool:
        return self.signals.failed

    def raise_failure(self, step: int):
        raise Raised("checkpoint failed")


def policy(signals: Signals, checkpoint_every=8, checkpoint_every_minutes=None, is_rank0=True, **kwargs) -> LoopPolicy:
    def nonfinite():
        raise Raised("nonfinite")

    options = dict(total_steps=20, log_every=2, eval_every=5, stop_flags=lambda: (signals.sigterm, signals.drain),
                   nonfinite=lambda: signals.tripped, on_nonfinite=nonfinite, clock=lambda: signals.now)
    return LoopPolicy(Collectives("cpu"), Checkpoints(signals, checkpoint_every, checkpoint_every_minutes, is_rank0),
                      **{**options, **kwargs})


def run(p: LoopPolicy, steps, before=lambda step: None):
    decisions = {}
    for step in steps:
        before(step)
        decisions[step] = p.after_step(step)
        if decisions[step].stop:
            break
    return decisions


def test_the_step_cadences_and_the_last_step():
    d = run(policy(Signals()), range(1, 21))
    assert [s for s, x in d.items() if x.checkpoint] == [8, 16, 20]
    assert [s for s, x in d.items() if x.evaluate] == [5, 10, 15, 20]
    assert [s for s, x in d.items() if x.log] == sorted({*range(2, 21, 2), 5, 15})
    assert [s for s, x in d.items() if x.final] == [20] and not any(x.stop for x in d.values())
    assert not any(x.evaluate for x in run(policy(Signals(), eval_every=None), range(1, 21)).values())


@pytest.mark.parametrize("flag, reason", [("sigterm", SIGTERM), ("drain", DRAIN)])
def test_a_preemption_checkpoints_and_stops_delay_steps_after_it_was_seen(flag, reason):
    signals = Signals()
    d = run(policy(signals), range(1, 21), before=lambda step: step == 3 and setattr(signals, flag, True))
    last = 3 + AGREEMENT_DELAY
    assert max(d) == last and d[last].stop == reason and d[last].preempt
    assert d[last].checkpoint and d[last].final and d[last].log
    assert not any(x.stop for s, x in d.items() if s < last)


def test_exit_after_steps_and_the_time_limit_exit_without_a_preemption():
    d = run(policy(Signals(), exit_after_steps=6), range(1, 21))
    assert max(d) == 6 and d[6].stop == EXIT_STEPS and not d[6].preempt and d[6].final and d[6].checkpoint
    signals = Signals()
    d = run(policy(signals, exit_after_minutes=1.0), range(1, 21), before=lambda step: setattr(signals, "now", 25.0 * step))
    assert max(d) == 3 + AGREEMENT_DELAY and d[max(d)].stop == TIME_UP and not d[max(d)].preempt  # 75 s > 60 s


def test_exit_after_steps_fires_at_the_first_step_past_it_after_a_resume():
    d = run(policy(Signals(), exit_after_steps=6), range(9, 21))  # resumed at step 8
    assert list(d) == [9] and d[9].stop == EXIT_STEPS and d[9].checkpoint


def test_the_time_limit_counts_from_the_commands_start_across_restarts():
    """A worker group restarted 50 s after the command started (`started_at`) has 10 s of its 60 left, not 60."""
    signals = Signals()
    signals.now = 50.0
    d = run(policy(signals, exit_after_minutes=1.0, started_at=0.0), range(1, 21),
            before=lambda step: setattr(signals, "now", 50.0 + 5.0 * step))
    assert max(d) == 3 + AGREEMENT_DELAY and d[max(d)].stop == TIME_UP  # 65 s after the start, raised at step 3


def test_a_time_based_checkpoint_is_taken_once_per_interval_on_rank_0_only():
    signals = Signals()
    step_cadence_off = dict(checkpoint_every=1000, checkpoint_every_minutes=1.0)
    d = run(policy(signals, **step_cadence_off), range(1, 21), before=lambda step: setattr(signals, "now", 10.0 * step))
    # due at step 6 (60 s), agreed at 8; the clock restarts at 8: due at 14, agreed at 16; then the last step
    assert [s for s, x in d.items() if x.checkpoint] == [6 + AGREEMENT_DELAY, 14 + AGREEMENT_DELAY, 20]
    signals = Signals()
    d = run(policy(signals, is_rank0=False, **step_cadence_off), range(1, 21),
            before=lambda step: setattr(signals, "now", 10.0 * step))
    assert [s for s, x in d.items() if x.checkpoint] == [20]


def test_a_step_checkpoint_meanwhile_cancels_a_due_one():
    signals = Signals()
    d = run(policy(signals, checkpoint_every=7, checkpoint_every_minutes=1.0), range(1, 21),
            before=lambda step: setattr(signals, "now", 10.0 * step))
    # due at 6, agreed at 8, but step 7 checkpointed: no checkpoint at 8
    assert [s for s, x in d.items() if x.checkpoint][:2] == [7, 14]


@pytest.mark.parametrize("flag, what", [("tripped", "nonfinite"), ("failed", "checkpoint failed")])
def test_non_finite_steps_and_a_failed_write_raise_delay_steps_later(flag, what):
    signals, seen = Signals(), []

    def raise_at(step):
        seen.append(step)
        if step == 4:
            setattr(signals, flag, torch.tensor(True) if flag == "tripped" else True)

    with pytest.raises(Raised, match=what):
        run(policy(signals), range(1, 21), before=raise_at)
    assert seen[-1] == 4 + AGREEMENT_DELAY
