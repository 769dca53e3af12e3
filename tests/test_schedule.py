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

