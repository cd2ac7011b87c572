"""The optimizer the configs name: optax AdamW, warm-up + cosine decay, gradient clipping."""

from __future__ import annotations

import optax


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float = 0.1,
                   clip_norm: float = 1.0, b1: float = 0.9, b2: float = 0.95,
                   name: str = 'adamw') -> optax.GradientTransformation:
  """`optax.<name>` under a warm-up + cosine schedule, after global-norm clipping.

  Args:
    lr: peak learning rate.
    steps: total steps (the cosine decays to 10% of `lr` at `steps`).
    warmup: linear warm-up steps.
    weight_decay, clip_norm, b1, b2: as in optax.
    name: an optax optimizer taking (learning_rate, b1, b2, weight_decay), e.g. 'adamw'.
  """
  if steps <= 0 or warmup < 0 or warmup >= steps:
    raise ValueError(f'optimizer: need 0 <= warmup ({warmup}) < steps ({steps}); lower '
                     '--config.train.warmup or raise --config.train.steps.')
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end_value=lr * 0.1)
  opt = getattr(optax, name)(learning_rate=schedule, b1=b1, b2=b2, weight_decay=weight_decay)
  return optax.chain(optax.clip_by_global_norm(clip_norm), opt)
