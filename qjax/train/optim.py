"""The optimizer the configs name: optax AdamW, warm-up + cosine decay, gradient clipping."""

from __future__ import annotations

import difflib
import math

import optax

# The optax optimizers with the (learning_rate, b1, b2, weight_decay) signature used here.
_OPTIMIZERS = ('adamw', 'adamaxw', 'lamb', 'nadamw', 'lion')


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
  if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
    raise ValueError(f'optimizer: lr={lr!r} must be a finite number > 0 (a learning rate '
                     '<= 0 trains uphill or not at all); e.g. --config.train.lr=3e-3.')
  if steps <= 0 or warmup < 0 or warmup >= steps:
    raise ValueError(f'optimizer: need 0 <= warmup ({warmup}) < steps ({steps}); lower '
                     '--config.train.warmup or raise --config.train.steps.')
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end_value=lr * 0.1)
  factory = getattr(optax, name, None) if isinstance(name, str) else None
  if not callable(factory):
    close = difflib.get_close_matches(str(name), _OPTIMIZERS, n=3)
    raise ValueError(f'optimizer: {name!r} is not an optax optimizer taking (learning_rate, '
                     f'b1, b2, weight_decay); use one of {list(_OPTIMIZERS)}'
                     + (f' (did you mean {close[0]!r}?)' if close else '') + '.')
  opt = factory(learning_rate=schedule, b1=b1, b2=b2, weight_decay=weight_decay)
  return optax.chain(optax.clip_by_global_norm(clip_norm), opt)
