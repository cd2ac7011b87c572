"""Pope et al. (2022) closed forms for feed-forward communication, exactly as published.

Each function returns the communication *volume* of one feed-forward layer (two matrices,
E x F and F x E) in elements per chip, as in the paper's Appendix A; divide by the
interconnect bandwidth in elements/s for time. The paper drops the (K-1)/K factor of a
collective over K chips; so do these functions. `estimate` does not use them: it counts
each collective of the real layer (gated FFNs, attention projections, (K-1)/K, the chosen
interconnect model), and the tests check that the two agree where they should.

Letters: B batch, L tokens per sequence in this pass, E d_model, F d_ff, n chips,
X chips along E (2D), N chips the weights are gathered over (weight-gathered).
"""

from __future__ import annotations

import math


def comm_1d_ws(batch: float, tokens: float, d_model: float) -> float:
  """1D weight-stationary: all-gather in + reduce-scatter out of BLE; independent of n."""
  return 2 * batch * tokens * d_model


def comm_2d_ws(batch: float, tokens: float, d_model: float, d_ff: float, x: float,
               yz: float) -> float:
  """2D weight-stationary with E split over `x` chips and F over `yz` chips.

  Args:
    batch: B.
    tokens: L.
    d_model: E.
    d_ff: F.
    x: chips along E.
    yz: chips along F (y * z).

  Returns:
    2 B L (E / X + F / YZ), in elements.
  """
  return 2 * batch * tokens * (d_model / x + d_ff / yz)


def optimal_2d_x(n_chips: float, d_model: float, d_ff: float) -> float:
  """The X minimising `comm_2d_ws` under X * YZ = n: sqrt(n E / F) (4 at n = 64, F = 4E)."""
  return math.sqrt(n_chips * d_model / d_ff)


def comm_2d_ws_optimal(batch: float, tokens: float, d_model: float, d_ff: float,
                       n_chips: float) -> float:
  """`comm_2d_ws` at the optimal X: 4 B L sqrt(E F / n), i.e. 8 B L E / sqrt(n) when F = 4E."""
  x = optimal_2d_x(n_chips, d_model, d_ff)
  return comm_2d_ws(batch, tokens, d_model, d_ff, x, n_chips / x)


def comm_weight_gathered(batch: float, tokens: float, d_model: float, d_ff: float,
                         n_chips: float, n_gather: float) -> float:
  """Weight-gathered over `n_gather` chips: (2 E F N / n + 2 B L E / N) elements.

  Args:
    batch: B.
    tokens: L.
    d_model: E.
    d_ff: F.
    n_chips: n.
    n_gather: N, the chips each weight is all-gathered over (X, XY or XYZ).

  Returns:
    The weight all-gather volume plus the remaining activation volume, in elements.
  """
  return 2 * d_model * d_ff * n_gather / n_chips + 2 * batch * tokens * d_model / n_gather


def optimal_gather_n(batch: float, tokens: float, d_ff: float, n_chips: float) -> float:
  """The N minimising `comm_weight_gathered`: sqrt(B L n / F)."""
  return math.sqrt(batch * tokens * n_chips / d_ff)


def model_flops_utilization(n_params: float, tokens: float, n_chips: int, peak_flops: float,
                            seconds: float) -> float:
  """MFU = 2 N tokens / (chips * peak * time); attention FLOPs are not counted.

  Args:
    n_params: N, all model parameters.
    tokens: tokens processed (prefill: B L; decode: B * generated tokens).
    n_chips: chips used.
    peak_flops: peak FLOP/s of one chip in the format the matmuls run in.
    seconds: wall time for those tokens.

  Returns:
    The fraction of peak spent on the 2 N FLOPs per token.
  """
  if seconds <= 0:
    raise ValueError(f'seconds must be > 0 to compute MFU, got {seconds}.')
  return 2 * n_params * tokens / (n_chips * peak_flops * seconds)
