"""The decode step's host side: the split cached per model, overflow checked without a sync,
and the float projections as 2-D dots (no per-call copy of a weight)."""

import dataclasses
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax.core.decode_paths import matrix_einsum
from qjax.nn import Transformer, TransformerConfig, generate, greedy_step, init_cache
from qjax.nn import model_split
from qjax.nn.attention import set_kv_format

CFG = TransformerConfig.tiny()


def _tokens(b, t, seed=0):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, CFG.vocab_size)


def _logits_then_token(model, prompt):
  """The argmax after `prompt` two ways: greedy_step, and a cache-free forward."""
  tok, _ = greedy_step(model, prompt, init_cache(CFG, prompt.shape[0], prompt.shape[1] + 1))
  return np.asarray(tok), np.asarray(jnp.argmax(model(prompt)[:, -1], -1))


def test_the_cached_split_sees_new_values_and_new_structure():
  model = Transformer(CFG, rngs=nnx.Rngs(0))
  prompt = _tokens(2, 5)
  got, want = _logits_then_token(model, prompt)
  np.testing.assert_array_equal(got, want)
  static = generate._split(model)[0]
  assert generate._split(model)[0] is static  # split once, not per step

  # A new value in a Variable the cached state holds: the next step uses it.
  w = model.embed.w
  w.set_value(jnp.roll(w.get_value(), 7, axis=0))
  got2, want2 = _logits_then_token(model, prompt)
  np.testing.assert_array_equal(got2, want2)
  assert generate._split(model)[0] is static
  assert not np.array_equal(want, want2)  # the change mattered

  # A replaced Variable and a new static attribute (a KV format) are a new structure.
  model.final_norm.scale = nnx.Param(model.final_norm.scale.get_value() + 3.0)
  assert generate._split(model)[0] is not static
  got3, want3 = _logits_then_token(model, prompt)
  np.testing.assert_array_equal(got3, want3)
  static = generate._split(model)[0]
  set_kv_format(model, 'int8')
  assert generate._split(model)[0] is not static
  assert generate._split(model)[0].graphdef == nnx.split(model)[0]

  # The cached split does not keep the model (and its arrays) alive.
  key = id(model)
  del model
  gc.collect()
  assert key not in model_split.SPLITS


def test_overflow_is_caught_from_host_lengths_and_from_a_foreign_cache():
  model = Transformer(CFG, rngs=nnx.Rngs(1))
  tok, cache = greedy_step(model, _tokens(2, 6), init_cache(CFG, 2, 8))
  assert generate._host_lengths(cache).tolist() == [6, 6]  # no device read next step
  tok, cache = greedy_step(model, tok[:, None], cache)
  tok, cache = greedy_step(model, tok[:, None], cache)  # exactly full
  assert generate._host_lengths(cache).tolist() == [8, 8]
  with pytest.raises(ValueError, match=r'row 0 has 8 cached \+ 1 new tokens exceed'):
    greedy_step(model, tok[:, None], cache)

  # Lengths set outside the steps (a rollback) are read from the device.
  rolled = dataclasses.replace(cache, length=jnp.asarray([3, 8], jnp.int32))
  assert generate._host_lengths(rolled) is None
  with pytest.raises(ValueError, match=r'row 1 has 8 cached \+ 1 new tokens exceed'):
    greedy_step(model, tok[:, None], rolled)


@pytest.mark.parametrize('spec,x_shape,w_shape', [
    ('BTNH,NHD->BTD', (2, 3, 4, 8), (4, 8, 16)),     # o_proj
    ('BTD,DNH->BTNH', (2, 3, 16), (16, 4, 8)),       # q_proj
    ('BTD,VD->BTV', (2, 3, 16), (32, 16)),           # the head: plain einsum
    ('TBD,DF->BFT', (3, 2, 16), (16, 24)),           # transposed activations and output
])
def test_matrix_einsum_equals_einsum(spec, x_shape, w_shape):
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, x_shape)
  w = jax.random.normal(kw, w_shape)
  want = jnp.einsum(spec, x, w, precision='highest')
  got = jax.jit(matrix_einsum, static_argnums=0)(spec, x, w)
  assert got.shape == want.shape and got.dtype == want.dtype
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.backend('cpu', reason="XLA:CPU's layout assignment for the o_proj einsum")
def test_o_proj_weight_is_not_copied_per_call():
  """The regression fixed here: XLA transposed an (N, H, D) weight to the activations' order."""
  x = jnp.zeros((1, 1, 4, 256))
  w = jnp.zeros((4, 256, 640))
  # The attention output order that made XLA move the transpose onto the weight.
  f = lambda xt, w: matrix_einsum('BTNH,NHD->BTD', jnp.swapaxes(xt, 2, 3), w)
  hlo = jax.jit(f).lower(jnp.swapaxes(x, 2, 3), w).compile().as_text()
  weight_sized = [l for l in hlo.splitlines() if ('copy' in l or 'transpose' in l) and
                  ('[256,4,640]' in l or '[1024,640]' in l or '[4,256,640]' in l) and
                  'parameter' not in l and 'bitcast(' not in l]
  assert not weight_sized, weight_sized


_SHUTDOWN_SCRIPT = '''
import gc
import jax.numpy as jnp
from flax import nnx
from qjax.nn import Transformer, TransformerConfig, greedy_step, init_cache, model_split
model = Transformer(TransformerConfig.tiny(num_layers=1), rngs=nnx.Rngs(0))
tok, cache = greedy_step(model, jnp.zeros((1, 3), jnp.int32), init_cache(model.config, 1, 8))
# What interpreter shutdown does: the module's globals become None while the tables (held
# here, as a dying model's state can hold them) are still alive; then the model dies.
shape = tok.shape
tables = [v for k, v in vars(model_split).items()  # the id-keyed weakref tables
          if isinstance(v, dict) and v and k[:2] != '__' and all(type(i) is int for i in v)]
for name in list(vars(model_split)):
  if not name.startswith('__'):
    setattr(model_split, name, None)
del model, tok, cache
gc.collect()
print(shape, 'tables', len(tables), 'left', sum(len(t) for t in tables))
'''


def test_no_exception_from_the_weakref_callbacks_at_shutdown():
  """The tables' weakref callbacks must not read module globals (None at shutdown)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  p = subprocess.run([sys.executable, '-c', _SHUTDOWN_SCRIPT], capture_output=True, text=True,
                     check=False, timeout=120)
  assert p.returncode == 0, p.stderr
  assert 'Exception ignored' not in p.stderr, p.stderr
  assert '(1,) tables 2 left 0' in p.stdout, p.stdout  # the callbacks ran


def test_argmax_last_equals_jnp_argmax_with_ties_and_nan():
  from qjax.nn.generate import argmax_last  # pylint: disable=g-import-not-at-top
  x = np.array(jax.random.normal(jax.random.key(3), (5, 1000)), np.float32)
  x[1, [10, 700]] = 9.0         # a tie: the first index wins
  x[2, [3, 600]] = np.nan       # NaN counts as the largest: the first NaN wins
  x[3] = -np.inf                # all -inf: index 0
  x[4, 999] = np.inf
  np.testing.assert_array_equal(jax.jit(argmax_last)(x), np.argmax(jnp.asarray(x), -1))
  assert list(np.asarray(argmax_last(x))[1:4]) == [10, 3, 0]
