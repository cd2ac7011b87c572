"""`EinsumQuant`: the one frozen description of how an `Einsum` layer quantizes.

Policies, QAT and PTQ methods change a layer by replacing its description
(`Einsum.set_quant`), never by editing attributes or swapping modules; a saved model records
each layer's description (`to_dict`) and is rebuilt from it (`from_dict`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from qjax.core import QFormat
from qjax.core.qdot import PATHS

OUTLIER_WEIGHTS = ('float', 'int8')
# The variables a description may imply, in `EinsumQuant.variables` order.
QUANT_VARIABLES = ('qat_scale', 'qat_zero_point', 'act_clip', 'in_scale', 'w_outlier')


def _format_from_dict(d) -> Optional[QFormat]:
  return None if d is None else QFormat(**d)


@dataclasses.dataclass(frozen=True)
class EinsumQuant:
  """How an `Einsum` quantizes: one frozen description, replaced (never edited) to change it.

  The default, `EinsumQuant()`, is a plain float (or weight-only quantized) projection.

  Attributes:
    act_fmt: activation format for W8A8 / fp8 x fp8 (its kind: activations are quantized
      dynamically per token), or None for weight-only. Quantized weights only.
    path: qeinsum compute path ('auto', 'dequant', 'tiled', 'kernel', 'int8', 'fp8').
      Quantized weights only, unless 'auto'.
    fake_fmt: a fully resolved weight format fake-quantized in the forward (QAT), or None.
      Float weights only.
    learn_scale: LSQ: the step size of `fake_fmt` (variable `qat_scale`) and, for an
      asymmetric format, its zero point (`qat_zero_point`) are learned; else they are
      recalibrated from the weight at every call.
    fake_act_fmt: format fake-quantizing the input (QAT of `act_fmt`), or None; needs
      `fake_fmt`.
    pact: the input is first clipped to [-a, a] by a learned PACT clip (variable `act_clip`),
      in the float, fake-quantized and quantized forward alike.
    input_scale: the input is divided by a fixed per-element scale (variable `in_scale`, the
      shape of the contracted weight axes in weight order) just before the product: an
      AWQ / SmoothQuant scale that no producer could absorb.
    outlier_threshold: LLM.int8() (Dettmers et al. 2022): input features whose max |x| over
      the call's tokens exceeds it are multiplied in the compute dtype, the rest int8 x int8
      (the activation format is then per token, whatever `act_fmt` says); None: plain
      `qeinsum`. Int8 weights only.
    outlier_weights: what the outlier features multiply under LLM.int8(): 'float' (a float
      copy of the weight, variable `w_outlier`; threshold 0 reproduces the float layer) or
      'int8' (the dequantized codes, what an int8-only deployment stores).
  """

  act_fmt: Optional[QFormat] = None
  path: str = 'auto'
  fake_fmt: Optional[QFormat] = None
  learn_scale: bool = False
  fake_act_fmt: Optional[QFormat] = None
  pact: bool = False
  input_scale: bool = False
  outlier_threshold: Optional[float] = None
  outlier_weights: str = 'float'

  def __post_init__(self):
    for name in ('act_fmt', 'fake_fmt', 'fake_act_fmt'):
      v = getattr(self, name)
      if v is not None and not isinstance(v, QFormat):
        raise ValueError(f'EinsumQuant: {name}={v!r} is not a QFormat; pass a QFormat or None.')
    if self.path not in PATHS:
      raise ValueError(f'EinsumQuant: path={self.path!r} is unknown; use one of {PATHS}.')
    if self.learn_scale and self.fake_fmt is None:
      raise ValueError('EinsumQuant: learn_scale=True learns the scale of fake_fmt, but '
                       'fake_fmt=None; give the weight format, or learn_scale=False.')
    if self.fake_act_fmt is not None and self.fake_fmt is None:
      raise ValueError(f'EinsumQuant: fake_act_fmt={self.fake_act_fmt.name} without fake_fmt; '
                       'activations are fake-quantized only with the weights (set fake_fmt).')
    if self.outlier_threshold is not None:
      t = float(self.outlier_threshold)
      if not t >= 0:
        raise ValueError(f'EinsumQuant: outlier_threshold={self.outlier_threshold!r} must be '
                         ">= 0 (6.0 in the LLM.int8() paper), or None for no decomposition.")
      object.__setattr__(self, 'outlier_threshold', t)
    if self.outlier_weights not in OUTLIER_WEIGHTS:
      raise ValueError(f'EinsumQuant: outlier_weights={self.outlier_weights!r} is unknown; use '
                       f'one of {OUTLIER_WEIGHTS}.')

  def replace(self, **kw) -> 'EinsumQuant':
    """A copy with `kw` changed (validated like a new one)."""
    return dataclasses.replace(self, **kw)

  @property
  def variables(self) -> tuple[str, ...]:
    """Names of the layer variables this description implies (a subset of QUANT_VARIABLES)."""
    out = []
    if self.learn_scale:
      out.append('qat_scale')
      if not self.fake_fmt.symmetric:
        out.append('qat_zero_point')
    if self.pact:
      out.append('act_clip')
    if self.input_scale:
      out.append('in_scale')
    if self.outlier_threshold is not None and self.outlier_weights == 'float':
      out.append('w_outlier')
    return tuple(out)

  def to_dict(self) -> dict:
    """JSON-able fields (formats as `QFormat.to_dict`); `from_dict` inverts it."""
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    for name in ('act_fmt', 'fake_fmt', 'fake_act_fmt'):
      d[name] = None if d[name] is None else d[name].to_dict()
    return d

  @classmethod
  def from_dict(cls, d: dict) -> 'EinsumQuant':
    """The description `to_dict` wrote; unknown fields raise (a record from another version)."""
    known = {f.name for f in dataclasses.fields(cls)}
    bad = set(d) - known
    if bad:
      raise ValueError(f'EinsumQuant.from_dict: unknown fields {sorted(bad)} (known: '
                       f'{sorted(known)}); the record was written by another qjax version.')
    d = dict(d)
    for name in ('act_fmt', 'fake_fmt', 'fake_act_fmt'):
      if name in d:
        d[name] = _format_from_dict(d[name])
    return cls(**d)
