"""qjax.kernels.tpu_gather in Pallas interpret mode: rows and their gradient."""

import jax
import jax.numpy as jnp
import numpy as np

from qjax.kernels import tpu_gather


def test_the_gradient_is_the_scatter_add_of_the_rows_cotangents():
  """A training step embeds through the kernel on a TPU; its gradient is XLA gather's."""
  table = jax.random.normal(jax.random.key(0), (16, 128), jnp.float32)
  ids = jnp.array([3, 7, 3, 15, 0], jnp.int32)
  w = jax.random.normal(jax.random.key(1), (5, 128), jnp.float32)
  loss = lambda t: jnp.sum(tpu_gather.gather_rows(t, ids, interpret=True) * w)
  reference = lambda t: jnp.sum(t[ids] * w)
  np.testing.assert_array_equal(tpu_gather.gather_rows(table, ids, interpret=True), table[ids])
  grad = jax.grad(loss)(table)
  np.testing.assert_allclose(grad, jax.grad(reference)(table), rtol=0, atol=0)
  np.testing.assert_allclose(grad[3], w[0] + w[2], rtol=1e-6)  # a row read twice sums
  bf16 = jax.grad(loss)(table.astype(jnp.bfloat16))
  assert bf16.dtype == jnp.bfloat16
