"""Planted calibration data shared by the algorithm tests (fixed seeds, small shapes)."""

import jax.numpy as jnp
import numpy as np


def correlated_inputs(m=1024, d=256, rank=8, seed=0):
  """X = Z A + low-rank structure: strongly correlated input channels, as in real layers."""
  rng = np.random.default_rng(seed)
  z = rng.normal(size=(m, d))
  mix = rng.normal(size=(d, d)) / np.sqrt(d)
  low = rng.normal(size=(m, rank)) @ rng.normal(size=(rank, d))
  return jnp.asarray((z @ mix + low).astype(np.float32))


def outlier_inputs(m=1024, d=256, n_out=6, mag=(10.0, 50.0), seed=0):
  """Unit-variance inputs with `n_out` channels scaled 10-50x (returns x, outlier indices)."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(m, d))
  idx = rng.choice(d, n_out, replace=False)
  x[:, idx] *= rng.uniform(*mag, size=n_out)
  return jnp.asarray(x.astype(np.float32)), idx


def weight(d=256, f=256, seed=1):
  rng = np.random.default_rng(seed)
  return jnp.asarray((rng.normal(size=(d, f)) / np.sqrt(d)).astype(np.float32))


def out_err(x, w, w_hat):
  """Frobenius norm of the layer output error ||X W - X W_hat||."""
  return float(jnp.linalg.norm(x @ w - x @ w_hat))
