"""Input checks shared by the PTQ algorithms: fail early, name the bad value and the fix."""

from __future__ import annotations

import numpy as np

from qjax.core import numerics
from qjax.core.formats import INT_BITS, QFormat, normalize_axis
from qjax.core.numerics import is_concrete  # noqa: F401  (re-exported for the algorithms)


def check_finite(x, what: str) -> None:
  """The core's finiteness check, with the fix for calibration statistics."""
  numerics.check_finite(x, what, 'calibration statistics must be finite. Find the layer or '
                        'batch that overflowed (e.g. run calibration in float32) and recollect '
                        'them.')


def check_nonnegative(x, what: str) -> None:
  """Raise if a concrete per-channel magnitude statistic has negative entries."""
  if x is None or not is_concrete(x):
    return
  a = np.asarray(x, dtype=np.float32)
  if (a < 0).any():
    i = int(np.argwhere(a < 0)[0][0])
    raise ValueError(f'{what}[{i}] = {a[i]:.4g} is negative; it should be a magnitude '
                     '(mean or max of |x|). Pass abs-statistics from the *_update helpers.')


def check_alpha(alpha, what: str) -> None:
  """Migration-strength exponents live in [0, 1]."""
  if not (0.0 <= float(alpha) <= 1.0):
    raise ValueError(f'{what}: alpha={alpha} is outside [0, 1]; 0 = no migration to the '
                     'weights, 1 = all of it (0.5 is the usual default).')


def check_int_weight_format(fmt: QFormat, what: str) -> None:
  """The weight formats the PTQ searches produce: int codes, groups along D, channels along F."""
  if not isinstance(fmt, QFormat):
    raise ValueError(f'{what}: fmt must be a qjax QFormat (e.g. int_format(4, group_size=128, '
                     f'channel_axes=(1,))), got {type(fmt).__name__}.')
  if fmt.is_float or fmt.bits not in INT_BITS:
    raise ValueError(f'{what}: format {fmt.name} is not supported; use integer codes with '
                     f'bits in {INT_BITS} (fp8 weights need no PTQ search: quantize them '
                     'directly).')
  if tuple(normalize_axis(a, 2, f'{what}: channel_axes') for a in fmt.channel_axes) not in (
      (), (1,)):
    raise ValueError(f'{what}: channel_axes={fmt.channel_axes} is not supported for a w_DF '
                     'weight; use (1,) (one scale per output channel F) or () and put any '
                     'granularity along D in group_size.')
  if fmt.group_size is not None and normalize_axis(fmt.group_axis, 2, f'{what}: group_axis'):
    raise ValueError(f'{what}: group_axis={fmt.group_axis} must be 0 (the contraction axis D '
                     'of w_DF); groups along F are per-channel scales, use channel_axes=(1,).')


def check_2d(w, what: str) -> None:
  if getattr(w, 'ndim', None) != 2:
    raise ValueError(f'{what}: expected a 2-d weight w_DF (input dim D, output dim F; '
                     f'y = x @ w), got shape {getattr(w, "shape", None)}. Reshape einsum '
                     'weights to (D, F) first.')


def check_last_dim(x, d: int, what: str) -> None:
  if x.shape[-1] != d:
    raise ValueError(f'{what}: activations have last dimension {x.shape[-1]} but the weight '
                     f'has D={d} input channels; pass the inputs *of this layer* (shape '
                     f'(..., {d})).')
