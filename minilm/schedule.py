"""Learning-rate schedule, counted in optimizer steps (never micro-steps)."""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "wsd")


def get_lr(step: int, total_steps: int, lr: float, warmup_steps: int = 0, min_lr_ratio: float = 0.1,
           schedule: str = "cosine", decay_fraction: float = 0.2) -> float:
    """lr at optimizer step `step` (0-based) of `total_steps`.

    Warmup rises linearly from lr/warmup_steps (step 0) to lr (step warmup_steps - 1). Then:
    * "cosine": a cosine from lr down to min_lr_ratio * lr over the remaining steps. With
      warmup_steps=0 and min_lr_ratio=0.1 this is exactly MiniMind's
      `lr * (0.1 + 0.45 * (1 + cos(pi * step / total)))`.
    * "wsd" (warmup-stable-decay): lr held until the last `decay_fraction` of the steps after warmup,
      then a straight line down to min_lr_ratio * lr, reached at the last step.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "wsd":
        decay_steps = max(1, round(decay_fraction * (total_steps - warmup_steps)))
        into_decay = step - (total_steps - decay_steps) + 1
        if into_decay <= 0:
            return lr
        return lr * (1.0 - (1.0 - min_lr_ratio) * min(1.0, into_decay / decay_steps))
    # Same operation order as MiniMind's get_lr (pi * step / total), so warmup 0 and ratio 0.1 match it bit for bit.
    angle = math.pi * (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) / 2 * (1 + math.cos(angle)))
