"""qjax.nn.traces: one count per trace (= compilation) of a jitted step, by name."""

import jax
import jax.numpy as jnp

from qjax.nn import traces


def test_a_step_counts_its_compilations_not_its_calls():
  @jax.jit
  def step(x):
    traces.traced('test.step')
    return x + 1

  before = traces.count('test.step')
  step(jnp.ones(3))
  step(jnp.ones(3))          # cached: no trace
  step(jnp.ones(4))          # a new shape: a new trace
  assert traces.count('test.step') - before == 2


def test_count_sums_the_names_given():
  before = traces.count('test.a', 'test.b')
  traces.traced('test.a')
  traces.traced('test.b')
  traces.traced('test.c')
  assert traces.count('test.a', 'test.b') - before == 2
  assert traces.count() == 0
