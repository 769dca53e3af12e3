"""`minilm.policy.LoopPolicy`: what the loop does after each step, at world size 1 (the agreement's all-reduce is
the identity; tests/test_nccl_rules.py and the torchrun tests run it on 2 ranks). Pure and fast."""

from __future__ import annotations

import pytest
import torch

from minilm.distributed import AGREEMENT_DELAY, Collectives
from minilm.policy import DRAIN, EXIT_STEPS, SIGTERM, TIME_UP, LoopPolicy


class Signals:
    def __init__(self):
        self.sigterm = self.drain = self.failed = False
        self.tripped = torch.tensor(False)
        self.now = 0.0


class Raised(Exception):
    pass


def policy(signals: Signals, **kwargs) -> LoopPolicy:
    def fail(what):
        def raise_():
            raise Raised(what)
        return raise_

    options = dict(start_step=0, total_steps=20, checkpoint_every=8, log_every=2, eval_every=5,
                   stop_flags=lambda: (signals.sigterm, signals.drain), checkpoint_failed=lambda: signals.failed,
                   nonfinite=lambda: signals.tripped, on_nonfinite=fail("nonfinite"),
                   on_checkpoint_failed=fail("checkpoint failed"), clock=lambda: signals.now)
    return LoopPolicy(Collectives("cpu"), **{**options, **kwargs})


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
