"""The lr schedule: MiniMind's cosine bit for bit without warmup; linear warmup; floor at min_lr_ratio."""

from __future__ import annotations

import math

import pytest

from minilm.schedule import get_lr


def minimind_lr(step: int, total: int, lr: float) -> float:
    # trainer_utils.get_lr in MiniMind (shared/seed/ quotes it).
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * step / total)))


@pytest.mark.parametrize("total", [1, 2, 3, 7, 10, 100, 1001, 5000])
@pytest.mark.parametrize("lr", [5e-4, 1e-3, 3.0])
def test_no_warmup_equals_minimind_formula_exactly(total, lr):
    for step in range(total):
        assert get_lr(step, total, lr) == minimind_lr(step, total, lr), step
        assert get_lr(step, total, lr, warmup_steps=0, min_lr_ratio=0.1) == minimind_lr(step, total, lr), step


def test_warmup_endpoints():
    lr, warmup, total = 1e-3, 10, 100
    assert get_lr(0, total, lr, warmup) == pytest.approx(lr / warmup, rel=1e-12)
    assert get_lr(warmup - 1, total, lr, warmup) == pytest.approx(lr, rel=1e-12)
    assert get_lr(warmup, total, lr, warmup) == pytest.approx(lr, rel=1e-12)  # cosine starts at lr
    for s in range(warmup):  # linear
        assert get_lr(s, total, lr, warmup) == pytest.approx(lr * (s + 1) / warmup, rel=1e-12)


@pytest.mark.parametrize("warmup,ratio", [(0, 0.1), (5, 0.1), (10, 0.0), (3, 0.5), (0, 1.0)])
def test_shape_monotone_and_floor(warmup, ratio):
    lr, total = 2e-3, 200
    lrs = [get_lr(s, total, lr, warmup, ratio) for s in range(total)]
    for a, b in zip(lrs[:warmup], lrs[1:warmup], strict=False):
        assert b >= a  # non-decreasing during warmup
    for a, b in zip(lrs[warmup:], lrs[warmup + 1:], strict=False):
        assert b <= a  # non-increasing after warmup
    assert all(0 < x <= lr + 1e-15 for x in lrs)  # never above lr
    # After warmup never below the floor (during warmup lr/warmup may be lower, by design).
    assert all(ratio * lr - 1e-15 <= x for x in lrs[warmup:])
    # The last step is close to the floor (the cosine reaches it at step == total).
    assert lrs[-1] == pytest.approx(ratio * lr, abs=lr * 1e-3)
    assert get_lr(total, total, lr, warmup, ratio) == pytest.approx(ratio * lr, rel=1e-12)


def test_seed_endpoints():
    lr = 5e-4
    assert get_lr(0, 1000, lr) == pytest.approx(lr, rel=1e-12)
    assert get_lr(999, 1000, lr) == pytest.approx(0.1 * lr, rel=1e-3)
    assert get_lr(500, 1000, lr) == pytest.approx(0.55 * lr, rel=1e-12)  # halfway: mean of lr and 0.1 lr


def test_min_lr_ratio_respected():
    lr, total = 1e-3, 50
    for ratio in (0.0, 0.05, 0.3):
        assert min(get_lr(s, total, lr, 0, ratio) for s in range(total + 1)) == pytest.approx(ratio * lr, abs=1e-15)



def wsd_reference(step: int, total: int, lr: float, warmup: int, ratio: float, fraction: float) -> float:
    """Warmup-stable-decay written out: linear warmup, lr held, then a line from lr to ratio * lr that ends at the
    last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    decay = max(1, round(fraction * (total - warmup)))
    first = total - decay  # the first step of the decay is already below lr
    if step < first:
        return lr
    return lr - (lr - ratio * lr) * (step - first + 1) / decay


@pytest.mark.parametrize("total,warmup", [(t, w) for t in (1, 2, 5, 10, 166, 1000) for w in (0, 1, 3) if w < t])
@pytest.mark.parametrize("ratio,fraction", [(0.1, 0.2), (0.0, 0.2), (0.0, 1.0), (0.5, 0.05)])
def test_wsd_holds_then_decays_linearly_to_the_floor_at_the_last_step(total, warmup, ratio, fraction):
    lr = 3e-3
    lrs = [get_lr(s, total, lr, warmup, ratio, "wsd", fraction) for s in range(total)]
    for s, x in enumerate(lrs):
        assert x == pytest.approx(wsd_reference(s, total, lr, warmup, ratio, fraction), rel=1e-12, abs=1e-18), s
    assert lrs[-1] == pytest.approx(ratio * lr, rel=1e-12, abs=1e-18)
    after = lrs[warmup:]
    assert all(b <= a for a, b in zip(after, after[1:], strict=False))
    held = sum(x == lr for x in after)
    assert held == (total - warmup) - max(1, round(fraction * (total - warmup)))


def test_wsd_spends_more_steps_at_the_peak_than_the_cosine():
    total, lr = 166, 5e-4
    cosine = sum(get_lr(s, total, lr) for s in range(total))
    wsd = sum(get_lr(s, total, lr, schedule="wsd") for s in range(total))
    assert wsd > cosine and get_lr(0, total, lr, schedule="wsd") == get_lr(0, total, lr) == lr
