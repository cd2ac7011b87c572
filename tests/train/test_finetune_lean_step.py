"""lean_step: the donated training step trains exactly as a plain autodiff step, leaves the
untrained variables (and a frozen model sharing their buffers) intact, refuses an empty filter.
A two-layer module stands in for a transformer: `lean_step` is generic over nnx models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax.train import lean_step, make_optimizer


class _Net(nnx.Module):
  """An embedding table (frozen in training) and two dense layers."""

  def __init__(self, seed: int):
    k = jax.random.split(jax.random.key(seed), 3)
    self.embed = nnx.Param(jax.random.normal(k[0], (16, 8)))
    self.up = nnx.Param(jax.random.normal(k[1], (8, 12)) / 3)
    self.down = nnx.Param(jax.random.normal(k[2], (12, 8)) / 3)

  def __call__(self, ids):
    return jnp.tanh(self.embed[...][ids] @ self.up[...]) @ self.down[...]


WRT = nnx.All(nnx.Param, nnx.Not(nnx.PathContains('embed')))


def _loss(m, t, ids):  # regress onto the frozen teacher's output for a shifted input
  return jnp.mean((m(ids) - jax.lax.stop_gradient(t((ids + 1) % 16))) ** 2)


def test_lean_step_equals_a_plain_step_and_keeps_shared_frozen_buffers():
  teacher = _Net(0)
  model, ref = _Net(1), _Net(1)
  for m in (model, ref):  # shared, as the QAT student's embedding is the teacher's
    m.embed.set_value(teacher.embed.get_value())
  tx = make_optimizer(1e-2, 3, 1, weight_decay=0.0)
  opt, ref_opt = nnx.Optimizer(model, tx, wrt=WRT), nnx.Optimizer(ref, tx, wrt=WRT)

  @nnx.jit
  def ref_step(m, o, t, ids):
    loss, grads = nnx.value_and_grad(_loss, argnums=nnx.DiffState(0, WRT))(m, t, ids)
    o.update(m, grads)
    return loss

  step = lean_step(model, opt, WRT, _loss, frozen=(teacher,))
  embed0 = np.asarray(teacher.embed.get_value())
  for i in range(3):
    ids = jax.random.randint(jax.random.key(10 + i), (4, 5), 0, 16)
    np.testing.assert_allclose(step(ids), ref_step(ref, ref_opt, teacher, ids), rtol=1e-6)
  for name in ('up', 'down'):
    np.testing.assert_allclose(getattr(model, name).get_value(),
                               getattr(ref, name).get_value(), rtol=1e-6, atol=1e-7)
  assert not np.array_equal(model.up.get_value(), _Net(1).up.get_value())  # it trained
  # The untrained, shared embedding is untouched and still readable through the teacher.
  np.testing.assert_array_equal(teacher.embed.get_value(), embed0)
  np.testing.assert_array_equal(model.embed.get_value(), embed0)
  assert int(opt.step.get_value()) == 3


def test_a_trained_array_shared_with_a_frozen_model_is_copied_not_freed():
  teacher = _Net(0)
  model = nnx.clone(teacher)  # shares every (immutable) array with the teacher
  opt = nnx.Optimizer(model, make_optimizer(1e-2, 3, 1), wrt=WRT)
  up0 = np.asarray(teacher.up.get_value())
  step = lean_step(model, opt, WRT, _loss, frozen=(teacher,))
  for _ in range(2):  # the warm-up's first step has lr 0
    step(jnp.zeros((2, 3), jnp.int32))
  np.testing.assert_array_equal(teacher.up.get_value(), up0)  # still alive, unchanged
  assert not np.array_equal(model.up.get_value(), up0)


def test_lean_step_refuses_a_filter_that_selects_nothing():
  model = _Net(0)
  opt = nnx.Optimizer(model, make_optimizer(1e-2, 3, 1), wrt=nnx.Param)
  with pytest.raises(ValueError, match='wrt selects no variable'):
    lean_step(model, opt, nnx.LoRAParam, lambda m, ids: jnp.mean(m(ids)))
