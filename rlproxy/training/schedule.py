"""Learning-rate schedules: the learning rate of optimizer update number s, as a pure function.

With base rate lr, W = warmup_steps, D = lr_decay_steps and the update count s (0 for the first
update, the optimizer state's `step` before the update):

  warmup     s < W:  lr * (s + 1) / W        (the first update is not wasted at 0; update W - 1
                                               is the first at the full rate)
  constant   lr
  linear     lr - (lr - lr_min) * min(d, D) / D                  d = s - W
  cosine     lr_min + (lr - lr_min) * (1 + cos(pi * min(d, D) / D)) / 2

and every rate times the trainer's `scale` (1, halved by each rollback of the eval gate). The
state a resume needs is the optimizer's own update count (saved with the optimizer state) and
`scale` (saved in trainer_state.json); the trainer sets the rate before each update.
Not here: the optimizer, checkpoints (training/learner.py, training/checkpoints.py).
"""

from __future__ import annotations

import math

from rlproxy.settings import TrainerSettings

SCHEDULE_FIELDS = ("lr_schedule", "learning_rate", "warmup_steps", "lr_min", "lr_decay_steps")


def lr_at(s: int, t: TrainerSettings, scale: float = 1.0) -> float:
    """The learning rate of update S (0-based) under T's schedule, times SCALE."""
    lr, lo = t.learning_rate, min(t.lr_min, t.learning_rate)
    if s < t.warmup_steps:
        return scale * lr * (s + 1) / t.warmup_steps
    frac = min(s - t.warmup_steps, t.lr_decay_steps) / t.lr_decay_steps
    if t.lr_schedule == "linear":
        lr = lr - (lr - lo) * frac
    elif t.lr_schedule == "cosine":
        lr = lo + (lr - lo) * (1 + math.cos(math.pi * frac)) / 2
    return scale * lr


def describe(t: TrainerSettings) -> dict:
    """The schedule's settings, as a checkpoint records them."""
    return {k: getattr(t, k) for k in SCHEDULE_FIELDS}
