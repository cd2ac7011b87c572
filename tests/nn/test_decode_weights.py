"""Decode loops on XLA:CPU without the kernel run bf16 weights as an f32 copy made once per
model (`decode_paths.DecodeWeights`); elsewhere they run the weights as they are."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax import kernels
from qjax.core import decode_paths
from qjax.nn import Transformer, TransformerConfig, generate

pytestmark = pytest.mark.backend('cpu', reason='the f32 copy is the XLA:CPU fallback only')


@pytest.fixture(scope='module')
def models():
  """A bf16-params tiny model, and the f32 model holding the same (exactly widened) values."""
  cfg = TransformerConfig.tiny(max_len=32)
  bf16 = Transformer(dataclasses.replace(cfg, param_dtype='bfloat16'), rngs=nnx.Rngs(5))
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(5)))
  f32 = nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(jnp.float32), nnx.state(bf16)))
  return bf16, f32


def _prompt():
  return jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 6)), jnp.int32)


def test_without_the_kernel_bf16_decodes_as_its_f32_copy(models, monkeypatch):
  bf16, f32 = models
  monkeypatch.setattr(kernels, 'available', lambda: False)
  assert decode_paths.widens_low_floats()
  _, state = generate._split(bf16)  # pylint: disable=protected-access
  dtypes = {a.dtype for a in jax.tree.leaves(state) if jnp.issubdtype(a.dtype, jnp.floating)}
  assert dtypes == {jnp.dtype(jnp.float32)}
  assert generate._split(bf16)[1] is state  # pylint: disable=protected-access
  np.testing.assert_array_equal(generate.greedy_generate(bf16, _prompt(), 8),
                                generate.greedy_generate(f32, _prompt(), 8))
  monkeypatch.setattr(kernels, 'info', lambda: {'status': 'disabled by QJAX_CPU_KERNEL=0'})
  assert 'f32 copy' in decode_paths.cpu_decode_forms()['decode_forms']['bf16']


def test_a_new_value_is_widened_again(models, monkeypatch):
  bf16 = Transformer(dataclasses.replace(models[0].config), rngs=nnx.Rngs(5))
  monkeypatch.setattr(kernels, 'available', lambda: False)
  before = generate.greedy_generate(bf16, _prompt(), 6)
  first = generate._split(bf16)[1]  # pylint: disable=protected-access
  w = bf16.embed.w
  w.set_value(jnp.flip(w.get_value(), axis=0))  # a new array in the same Variable
  second = generate._split(bf16)[1]  # pylint: disable=protected-access
  assert second is not first
  assert not np.array_equal(generate.greedy_generate(bf16, _prompt(), 6), before)


def test_with_the_kernel_the_state_is_the_models_own(models, monkeypatch):
  monkeypatch.setattr(kernels, 'available', lambda: True)
  assert not decode_paths.widens_low_floats()
  _, state = generate._split(models[0])  # pylint: disable=protected-access
  assert any(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(state))
