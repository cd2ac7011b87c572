"""The fused attention forms against a float64 reference, and the one place that picks them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax import target as qjax_target
from qjax.kernels import splash
from qjax.nn import Transformer, TransformerConfig, attend, init_cache, layer_forms
from qjax.nn import attention_forms
from qjax.nn.attention_core import attend_reduce
from qjax.nn.attention_forms import choose_form, fused_attend


def reference(q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, window=None, softcap=None):
  """Attention in float64 numpy, written from the definition (heads repeated, not grouped)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q_BTNH, k_BSKH, v_BSKH))
  g = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  logits = np.einsum('btnh,bsnh->bnts', q, k)
  if softcap is not None:
    logits = softcap * np.tanh(logits / softcap)
  diff = np.asarray(q_pos_BT)[:, :, None] - np.asarray(k_pos_BS)[:, None, :]
  ok = diff >= 0
  if window is not None:
    ok &= diff < window
  logits = np.where(ok[:, None], logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum('bnts,bsnh->btnh', p, v)


def qkv(b, t, n, kh, h, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (b, t, n, h)) * 0.5, jax.random.normal(ks[1], (b, t, kh, h)),
          jax.random.normal(ks[2], (b, t, kh, h)))


@pytest.mark.parametrize('heads,window,softcap', [  # MHA, GQA, MQA
    ((4, 4), None, None), ((4, 2), 5, None), ((4, 1), None, 20.0), ((2, 1), 7, 30.0)])
def test_splash_interpret_matches_float64_reference(heads, window, softcap):
  n, kh = heads
  q, k, v = qkv(2, 40, n, kh, 32)
  pos = jnp.broadcast_to(jnp.arange(40), (2, 40))
  out = splash.splash_attention(q, k, v, window=window, logit_softcap=softcap,
                                interpret=True)
  np.testing.assert_allclose(out, reference(q, k, v, pos, pos, window, softcap), atol=2e-5)


@pytest.mark.parametrize('heads', [(4, 2), (2, 1)])
@pytest.mark.parametrize('window', [None, 6])
def test_sdpa_xla_matches_float64_reference_over_a_cache(heads, window):
  n, kh = heads
  q, k, v = qkv(2, 9, n, kh, 16)
  q_pos = jnp.asarray([[3 + i for i in range(9)], [i for i in range(9)]])  # ragged rows
  k_pos = jnp.asarray([list(range(3, 12)), [0, 1, 2, 3, 4, 5, 6, 7, 2 ** 30]])
  out = fused_attend('sdpa_xla', q, k, v, q_pos, k_pos, window=window)
  np.testing.assert_allclose(out, reference(q, k, v, q_pos, k_pos, window), atol=2e-5)


@pytest.mark.parametrize('heads,window,softcap', [((4, 2), None, None), ((4, 1), 5, 20.0)])
def test_decode_reduce_matches_float64_reference_and_dense(heads, window, softcap):
  n, kh = heads
  q, _, _ = qkv(3, 1, n, kh, 16, seed=1)
  _, k, v = qkv(3, 12, n, kh, 16, seed=2)
  q_pos = jnp.asarray([[11], [4], [0]])  # ragged rows: slots past a row's position are stale
  k_pos = jnp.broadcast_to(jnp.arange(12), (3, 12))
  out = attend_reduce(q, k, v, q_pos, k_pos, window=window, logit_softcap=softcap)
  want = reference(q, k, v, q_pos, k_pos, window, softcap)
  np.testing.assert_allclose(out, want, atol=2e-5)
  dense = attend(q, k, v, q_pos, k_pos, window=window, logit_softcap=softcap)
  np.testing.assert_allclose(out, dense, atol=2e-5)
  # A NaN in a slot a row cannot see adds nothing to it; one it can see makes it NaN.
  bad = v.at[1, 7].set(jnp.nan)  # row 1 (position 4) cannot see slot 7
  for f in (attend_reduce, attend):
    got = f(q, k, bad, q_pos, k_pos, window=window, logit_softcap=softcap)
    np.testing.assert_allclose(got, want, atol=2e-5)
    seen = f(q, k, v.at[0, 11].set(jnp.nan), q_pos, k_pos, window=window,
             logit_softcap=softcap)
    assert bool(jnp.all(jnp.isnan(seen[0]))) and bool(jnp.all(jnp.isfinite(seen[1:])))


def test_index_masked_forms_fall_back_to_the_scan_when_positions_are_not_consecutive():
  q, k, v = qkv(1, 24, 4, 2, 16)
  gap = jnp.concatenate([jnp.arange(12), jnp.arange(12) + 20])[None]  # a jump: not aligned
  out = fused_attend('splash', q, k, v, gap, gap, window=9, interpret=True, block_size=8)
  np.testing.assert_allclose(out, reference(q, k, v, gap, gap, 9), atol=2e-5)


def test_splash_gradients_match_dense():
  q, k, v = qkv(1, 32, 4, 2, 16, seed=1)
  pos = jnp.arange(32)[None]
  loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
  fused = loss(lambda q, k, v: fused_attend('splash', q, k, v, pos, pos, window=11,
                                            logit_softcap=25.0, interpret=True))
  dense = loss(lambda q, k, v: attend(q, k, v, pos, pos, window=11, logit_softcap=25.0))
  for a, b in zip(jax.grad(fused, (0, 1, 2))(q, k, v), jax.grad(dense, (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(a, b, atol=5e-5)


@pytest.mark.parametrize('on,impl,dtype,softcap,head_dim,want', [
    ('cpu', 'auto', 'float32', None, 64, 'dense'),
    ('cpu', 'fused', 'float32', None, 64, 'sdpa_xla'),
    ('cpu', 'fused', 'float32', 50.0, 64, 'unfused'),
    ('nvidia', 'auto', 'bfloat16', None, 64, 'cudnn'),
    ('nvidia', 'auto', 'bfloat16', None, 256, 'unfused'),  # Gemma 3 head dim, before Hopper
    ('nvidia', 'auto', 'float32', None, 64, 'unfused'),
    ('nvidia', 'fused', 'bfloat16', 50.0, 64, 'unfused'),  # Gemma 2 softcap
    ('tpu', 'auto', 'float32', 50.0, 256, 'splash'),
    ('tpu', 'dense', 'bfloat16', None, 64, 'dense'),
])
def test_choose_form_per_platform(on, impl, dtype, softcap, head_dim, want):
  short, long = (choose_form(impl, t=t, dtype=dtype, head_dim=head_dim, logit_softcap=softcap,
                             on=on, capability=(8, 0)) for t in (64, 4096))
  if want == 'unfused':  # no fused kernel takes it: dense while short, blockwise when long
    assert (short.name, long.name) == ('dense', 'blockwise'), (short, long)
    assert 'cannot take' in long.reason or 'softcap' in long.reason
  else:
    assert short.name == long.name == want, short
  decode = choose_form(impl, t=1, dtype=dtype, head_dim=head_dim, on=on).name
  assert decode == ('reduce' if on == 'nvidia' else 'dense')


def test_cudnn_takes_head_dim_256_from_hopper_on():
  form = lambda h, cc: choose_form('auto', t=512, dtype='bfloat16', head_dim=h, on='nvidia',
                                   capability=cc)
  assert form(256, (9, 0)).name == form(256, (10, 0)).name == 'cudnn'
  assert form(256, (8, 9)).name == 'dense' and 'up to 128' in form(256, (8, 9)).reason
  assert form(264, (9, 0)).name == 'dense' and 'up to 256' in form(264, (9, 0)).reason
  assert form(128, (8, 0)).name == 'cudnn'
  assert attention_forms.cudnn_max_head_dim(None) == 128  # unknown: before Hopper


def test_the_form_follows_the_target_not_the_host():
  """Traced for an abstract H100 or a TPU from this host, the choice is that device's."""
  h100 = qjax_target.Target('nvidia', 'NVIDIA H100 80GB HBM3', compute_capability=(9, 0))
  with qjax_target.use(h100):
    assert choose_form('auto', t=512, dtype='bfloat16', head_dim=256).name == 'cudnn'
  with qjax_target.use(qjax_target.Target('nvidia', 'NVIDIA A100', compute_capability=(8, 0))):
    assert choose_form('auto', t=512, dtype='bfloat16', head_dim=256).name == 'dense'
  with qjax_target.use('tpu'):
    assert choose_form('auto', t=512, dtype='bfloat16', head_dim=256).name == 'splash'
  gpu = jax.sharding.AbstractDevice(device_kind='NVIDIA H200', num_cores=None, platform='cuda')
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ('x',),
                                                                abstract_device=gpu)):
    assert qjax_target.current().compute_capability == (9, 0)
    assert choose_form('auto', t=512, dtype='bfloat16', head_dim=256).name == 'cudnn'


def test_unknown_impl_is_refused_with_the_choices():
  with pytest.raises(ValueError, match="attention_impl='flash' is unknown.*'fused'"):
    TransformerConfig.tiny(attention_impl='flash')


def test_fused_model_forward_grad_and_cached_prefill_match_dense():
  cfg = TransformerConfig.tiny(sliding_window=6, global_every=2, num_layers=2)
  dense = Transformer(cfg.replace(attention_impl='dense'), rngs=nnx.Rngs(0))
  fused = Transformer(cfg.replace(attention_impl='fused'), rngs=nnx.Rngs(0))
  assert [f.name for f in layer_forms(fused, 16)] == ['sdpa_xla'] * 2
  assert [f.name for f in layer_forms(fused, 1)] == ['dense'] * 2
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(16), (2, 16))

  @nnx.jit
  def run(model):
    grads = nnx.grad(lambda m: jnp.mean(m(tokens) ** 2))(model)
    cached, _ = model.run_layers(model.embed_tokens(tokens), pos, init_cache(cfg, batch=2))
    return model(tokens), grads, cached
  for a, b in zip(jax.tree.leaves(run(fused)), jax.tree.leaves(run(dense))):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_splash_lowers_for_tpu():
  q, k, v = qkv(1, 256, 4, 1, 128)
  f = jax.jit(lambda q, k, v: splash.splash_attention(q, k, v, window=64))
  text = jax.export.export(f, platforms=['tpu'])(q, k, v).mlir_module()
  assert 'tpu_custom_call' in text


@pytest.mark.parametrize('start', [0, 3])  # a fresh row (fused over its own keys), a later chunk
def test_prefill_against_a_cache_runs_over_own_keys_only_from_position_zero(start):
  q, k, v = qkv(1, 20, 2, 1, 16, seed=2)
  q, k_new, v_new = q[:, :12], k[:, start:start + 12], v[:, start:start + 12]
  q_pos = jnp.arange(start, start + 12)[None]
  k_pos = jnp.arange(20)[None]  # the cache's slots; slots past the chunk hold stale keys
  out = fused_attend('splash', q, k, v, q_pos, k_pos, own=(k_new, v_new), window=5,
                     interpret=True, block_size=8)
  np.testing.assert_allclose(out, reference(q, k, v, q_pos, k_pos, 5), atol=2e-5)


def test_a_call_cudnn_refuses_runs_the_scan(monkeypatch):
  """cuDNN's checks run while the call is traced; a refusal there falls back, exactly."""
  real = jax.nn.dot_product_attention

  def cudnn_refuses(*args, implementation=None, **kw):
    if implementation == 'cudnn':
      raise RuntimeError('cuDNN is not detected.')
    return real(*args, implementation=implementation, **kw)
  monkeypatch.setattr(jax.nn, 'dot_product_attention', cudnn_refuses)
  q, k, v = qkv(1, 20, 4, 2, 16, seed=3)
  pos = jnp.arange(20)[None]
  out = fused_attend('cudnn', q, k, v, pos, pos, window=7, block_size=8)
  np.testing.assert_allclose(out, reference(q, k, v, pos, pos, 7), atol=2e-5)


@pytest.mark.backend('cpu', reason="'auto' is dense on CPU only")
def test_temp_bytes_measure_the_form_each_impl_runs():
  from qjax.infer import attention_temp_bytes  # pylint: disable=g-import-not-at-top
  temp = {impl: attention_temp_bytes(512, impl, block_size=64)
          for impl in ('auto', 'fused', 'dense', 'blockwise')}
  assert temp['auto'] == temp['dense']
  assert temp['blockwise'] < temp['dense'] / 2  # O(T * block), not O(T * S)
  assert temp['fused'] > 0  # sdpa_xla on CPU: dense math
