"""QAT: STE / LSQ gradients in a model, train == serve, learned scales, PTQ init, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from qjax.algorithms import apply_method
from qjax.core import compute_range, int_format, fp8_format, scale_and_zero_point
from qjax.nn import (EinsumQuant, QuantPolicy, QuantRule, Transformer, TransformerConfig,
                     einsum_layers, quantize_model)
from qjax.train import (QATScale, convert, learned_scales, make_optimizer, make_qat_optimizer,
                        prepare_qat, qat_step, range_for)

CFG = TransformerConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=32, d_ff=64, max_len=32)
UP = 'layers/0/mlp/up_proj'


@pytest.fixture(scope='module')
def model():
  return Transformer(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope='module')
def tokens():
  return jax.random.randint(jax.random.key(1), (2, 16), 0, CFG.vocab_size)


def _policy(fmt, path='dequant', act=None):
  return QuantPolicy((QuantRule('embed', exempt=True), QuantRule('.*', fmt, act=act)), path=path)


# One jitted forward for the module (a fresh nnx.jit per call traced and compiled every time).
_forward = nnx.jit(lambda m, t: m(t))


def _logits(m, tokens):
  return np.asarray(_forward(m, tokens))


def _train(m, steps=3, scale_lr=1e-2, lr=1e-2):
  learned = bool(jax.tree.leaves(nnx.state(m, QATScale)))
  opt = make_qat_optimizer(m, make_optimizer(lr, 10, 1), scale_lr=scale_lr if learned else None)
  for i in range(steps):
    qat_step(m, opt, jax.random.randint(jax.random.key(10 + i), (4, 17), 0, CFG.vocab_size))
  return m


def _layer(m, path):
  return dict(einsum_layers(m))[path]


# ---- gradients ---------------------------------------------------------------------------
def test_ste_gradient_in_a_model_is_identity_inside_zero_outside(model, tokens):
  """d loss / d w equals d loss / d w_hat (at the fake-quantized weight) or 0 if clipped."""
  pol = _policy(int_format(4))
  up = model.layers[0].mlp.up_proj.w[...]
  lo, hi = compute_range(up, _layer(prepare_qat(model, pol)[0], UP).quant.fake_fmt)
  half = {UP: (lo * 0.5, hi * 0.5)}  # a clipping range: some weights fall outside it
  qat, _ = prepare_qat(model, pol, learn_scales=UP, ranges=half)
  layer = _layer(qat, UP)
  w_hat = layer.fake_weight(layer.w[...])
  ref = nnx.clone(qat)
  _layer(ref, UP).w[...] = w_hat
  _layer(ref, UP).quant = EinsumQuant()  # float again: no fake format, no learned scale

  def grad_up(m):
    g = nnx.jit(nnx.grad(lambda m: jnp.sum(m(tokens) ** 2) * 1e-3))(m)  # eager: 2.7x slower
    return np.asarray(g['layers'][0]['mlp']['up_proj']['w'][...])

  g, g_ref = grad_up(qat), grad_up(ref)
  s = np.asarray(learned_scales(qat)[UP][0])
  v = np.asarray(layer.w[...]) / s
  inside = np.abs(v) <= 7
  assert 0 < (~inside).sum() < inside.sum()
  np.testing.assert_array_equal(g[~inside], 0.0)
  np.testing.assert_allclose(g[inside], g_ref[inside], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize('symmetric', [True, False])
def test_lsq_gradients_match_the_paper_and_finite_differences(symmetric):
  """dL/ds = sum G (round(v) - v) inside, G * bound outside; dL/dz = -s sum G outside."""
  fmt = int_format(3, symmetric=symmetric)
  m = Transformer(CFG, rngs=nnx.Rngs(3))
  pol = QuantPolicy((QuantRule('layers/0/mlp/up_proj', fmt, granularity='tensor'),))
  qat, _ = prepare_qat(m, pol, learn_scales=True)
  layer = qat.layers[0].mlp.up_proj
  s0 = float(layer.qat_scale[...].ravel()[0]) * 0.6  # some weights clip
  layer.qat_scale[...] = jnp.full_like(layer.qat_scale[...], s0)
  x = jax.random.normal(jax.random.key(4), (1, 3, CFG.d_model))
  r = jax.random.normal(jax.random.key(5), (1, 3, CFG.d_ff))
  loss = lambda l: jnp.sum(l(x) * r)  # linear in w_hat: G = dL/dw_hat = x^T r
  grads = nnx.grad(loss, argnums=nnx.DiffState(0, QATScale))(layer)
  w = np.asarray(layer.w[...], np.float64)
  G = np.einsum('btd,btf->df', np.asarray(x, np.float64), np.asarray(r, np.float64))
  s, z = (float(np.ravel(a)[0]) if a is not None else 0.0  # per-tensor: one scale
          for a in learned_scales(qat)['layers/0/mlp/up_proj'])
  v = w / s + z
  lo_code, hi_code = fmt.qmin, fmt.qmax
  inside = (v >= lo_code) & (v <= hi_code)
  assert 0 < (~inside).sum()
  ds = np.where(inside, np.round(v) - v, np.clip(v, lo_code, hi_code) - z)
  np.testing.assert_allclose(float(grads['qat_scale'][...].sum()), (G * ds).sum(), rtol=2e-4)
  if not symmetric:
    dz = np.where(inside, 0.0, -s)
    np.testing.assert_allclose(float(grads['qat_zero_point'][...].sum()), (G * dz).sum(),
                               rtol=2e-4)

  # Finite differences of LSQ's surrogate: rounding offsets (and clipped codes) frozen at s.
  c = np.round(v) - v
  def surrogate(t):
    inner = (w / t + z + c - z) * t
    outer = (np.clip(v, lo_code, hi_code) - z) * t
    return (G * np.where(inside, inner, outer)).sum()
  eps = 1e-6 * s
  fd = (surrogate(s + eps) - surrogate(s - eps)) / (2 * eps)
  np.testing.assert_allclose(float(grads['qat_scale'][...].sum()), fd, rtol=2e-4)


# ---- what you train is what you serve ----------------------------------------------------
@pytest.mark.parametrize('fmt,learn', [
    (int_format(4, group_size=16, pow2_scale=True), False),
    (int_format(4, group_size=16, pow2_scale=True), True),
    (int_format(3, symmetric=False, pow2_scale=True), True),
    (int_format(8, pow2_scale=True, scale_dtype='bfloat16'), True)],
    ids=lambda v: v.name if hasattr(v, 'name') else ('learned' if v else 'dynamic'))
def test_pow2_fake_quant_forward_equals_converted_model_bit_for_bit(model, tokens, fmt, learn):
  pol = _policy(fmt)
  qat = _train(prepare_qat(model, pol, learn_scales=learn)[0])
  qmodel, report = convert(qat, pol)
  down = 'layers/0/mlp/down_proj'
  assert report[down].weight == _layer(qat, down).quant.fake_fmt.name
  np.testing.assert_array_equal(_logits(qat, tokens), _logits(qmodel, tokens))
  np.testing.assert_array_equal(qat(tokens), qmodel(tokens))  # eager too


@pytest.mark.parametrize('learn', [False, True])
def test_other_scales_agree_within_float_rounding(model, tokens, learn):
  """Stated tolerance without power-of-two scales: 1e-5 of the logit scale (observed: 0)."""
  pol = _policy(int_format(4, group_size=16, symmetric=False, scale_dtype='bfloat16'))
  qat = _train(prepare_qat(model, pol, learn_scales=learn)[0])
  a, b = _logits(qat, tokens), _logits(convert(qat, pol)[0], tokens)
  np.testing.assert_allclose(a, b, atol=1e-5 * np.abs(a).max())


def test_learned_scales_are_stored_exactly(model):
  pol = _policy(int_format(4, symmetric=False, group_size=16))
  qat = _train(prepare_qat(model, pol, learn_scales=True)[0], steps=4)
  qmodel, _ = convert(qat, pol)
  for path, (s, z) in learned_scales(qat).items():
    q = _layer(qmodel, path).w.get_value()
    np.testing.assert_array_equal(q.scale, s)
    np.testing.assert_array_equal(q.zero_point, z)
  # the scales did move away from their calibrated start
  fmt = _layer(qat, UP).quant.fake_fmt
  s0, _ = scale_and_zero_point(*compute_range(model.layers[0].mlp.up_proj.w[...], fmt), fmt)
  assert not np.array_equal(np.asarray(s0), np.asarray(learned_scales(qat)[UP][0]))


def test_range_for_inverts_pow2_and_bf16_scales():
  for fmt in (int_format(4, pow2_scale=True), int_format(2, symmetric=False, pow2_scale=True),
              int_format(8, scale_dtype='bfloat16'), fp8_format('e4m3', pow2_scale=True)):
    x = jax.random.normal(jax.random.key(0), (64, 8)) * 3
    s, z = scale_and_zero_point(*compute_range(x, fmt.replace(channel_axes=(1,))), fmt)
    got = scale_and_zero_point(*range_for(s, z, fmt), fmt)
    np.testing.assert_array_equal(got[0], s)
    if z is not None:
      np.testing.assert_array_equal(got[1], z)


def test_activation_qat_and_pact_convert_within_tolerance(model, tokens):
  """W4A8: fake-quant activations as qeinsum's int8 path does; PACT clips kept when served."""
  pol = _policy(int_format(4, group_size=16), path='int8', act=int_format(8))
  qat, _ = prepare_qat(model, pol, learn_scales=True, act=True, pact=0.5)
  layer = _layer(qat, UP)
  act = layer.quant.fake_act_fmt
  assert act.channel_axes == (0, 1) and act.group_size == 16
  o_proj = _layer(qat, 'layers/0/attn/o_proj').quant.fake_act_fmt  # per token, head, H-group
  assert o_proj.channel_axes == (0, 1, 2) and o_proj.group_axis == 3
  # Jitted: eagerly, every op of the fake-quantized model's backward pass compiled on its own.
  g = nnx.jit(nnx.grad(lambda m: jnp.sum(m(tokens * 0 + 3) ** 2),
                       argnums=nnx.DiffState(0, QATScale)))(qat)
  assert float(jnp.abs(g['layers'][0]['mlp']['up_proj']['act_clip'][...])) > 0  # PACT learns
  qat = _train(qat)
  qmodel, _ = convert(qat, pol)
  served = _layer(qmodel, UP)
  assert served.act_clip is not None and served.quant.pact and served.quant.act_fmt is not None
  a, b = _logits(qat, tokens), _logits(qmodel, tokens)
  # Integer accumulation vs float accumulation of the same codes: rounding only.
  np.testing.assert_allclose(a, b, atol=1e-3 * np.abs(a).max())


# ---- learned scales: optimizer partition --------------------------------------------------
def test_scales_have_their_own_learning_rate(model):
  pol = _policy(int_format(4, group_size=16))
  qat, _ = prepare_qat(model, pol, learn_scales=True)
  w0 = np.asarray(_layer(qat, UP).w[...])
  s0 = np.asarray(_layer(qat, UP).qat_scale[...])
  opt = make_qat_optimizer(qat, optax.sgd(0.0), scale_lr=1e-2)
  qat_step(qat, opt, jax.random.randint(jax.random.key(0), (4, 17), 0, CFG.vocab_size))
  np.testing.assert_array_equal(_layer(qat, UP).w[...], w0)  # weights: lr 0
  assert not np.array_equal(_layer(qat, UP).qat_scale[...], s0)  # scales: their own lr
  qat2, _ = prepare_qat(model, pol, learn_scales=True)
  opt2 = make_qat_optimizer(qat2, optax.sgd(1e-2), scale_tx=optax.sgd(0.0))
  qat_step(qat2, opt2, jax.random.randint(jax.random.key(0), (4, 17), 0, CFG.vocab_size))
  np.testing.assert_array_equal(_layer(qat2, UP).qat_scale[...], s0)
  assert not np.array_equal(_layer(qat2, UP).w[...], w0)


# ---- initialisation from PTQ --------------------------------------------------------------
@pytest.mark.parametrize('fmt', [int_format(3, group_size=16, pow2_scale=True),
                                 int_format(4, symmetric=False, group_size=16)],
                         ids=lambda f: f.name)
def test_qat_starts_from_a_ptq_model(model, tokens, fmt):
  """Bit for bit with power-of-two scales; otherwise a learned scale may sit an ulp off.

  (`quantize` takes ranges, and not every float32 scale is `amax * (1/qmax)` of some amax.)
  """
  pol = _policy(fmt)
  ptq, _ = quantize_model(model, pol, calibration='mse')  # a PTQ result other than absmax
  qat, _ = prepare_qat(ptq, pol, learn_scales=True)
  exact = fmt.pow2_scale
  check = lambda a, b, tol: (np.testing.assert_array_equal(a, b) if exact else
                             np.testing.assert_allclose(a, b, rtol=tol, atol=tol))
  check(_logits(qat, tokens), _logits(ptq, tokens), 1e-5)
  for path, (s, z) in learned_scales(qat).items():
    q = _layer(ptq, path).w.get_value()
    check(s, q.scale, 3e-7)
    if z is not None:
      np.testing.assert_array_equal(z, q.zero_point)
  check(_logits(convert(qat, pol)[0], tokens), _logits(ptq, tokens), 1e-5)


def test_qat_starts_from_per_layer_ranges(model):
  pol = _policy(int_format(4, group_size=16))
  fmt = _layer(prepare_qat(model, pol)[0], UP).quant.fake_fmt
  lo, hi = compute_range(model.layers[0].mlp.up_proj.w[...], fmt, 'mse')
  qat, _ = prepare_qat(model, pol, learn_scales=True, ranges={UP: (lo, hi)})
  np.testing.assert_allclose(learned_scales(qat)[UP][0], scale_and_zero_point(lo, hi, fmt)[0],
                             rtol=3e-7)
  with pytest.raises(ValueError,
                     match=r'has shape \(1, 64\), expected \(2, 64\) \(the scale layout'):
    prepare_qat(model, pol, learn_scales=True, ranges={UP: (lo[:1], hi[:1])})


def test_qat_starts_from_gptq(model, tokens):
  pol = _policy(int_format(4, group_size=16, pow2_scale=True))
  calib = np.asarray(jax.random.randint(jax.random.key(7), (8, 16), 0, CFG.vocab_size))
  ptq, _, _ = apply_method(model, pol, 'gptq', calib)
  qat, _ = prepare_qat(ptq, pol, learn_scales=True)
  np.testing.assert_array_equal(_logits(qat, tokens), _logits(ptq, tokens))


# ---- bad input -----------------------------------------------------------------------------
def test_bad_input_is_a_clear_value_error(model):
  pol = _policy(int_format(4))
  with pytest.raises(ValueError, match='1-bit'):
    int_format(1)
  with pytest.raises(ValueError, match='no learned scales'):  # dynamic scales: nothing to learn
    make_qat_optimizer(prepare_qat(model, pol)[0], optax.adam(1e-3), scale_lr=1e-3)
  float_pol = QuantPolicy((QuantRule('.*', exempt=True),))
  with pytest.raises(ValueError, match='no learned scales'):  # every layer float
    make_qat_optimizer(prepare_qat(model, float_pol)[0], optax.adam(1e-3), scale_lr=1e-3)
  with pytest.raises(ValueError, match='no scale to learn'):  # an exempt layer
    prepare_qat(model, pol, learn_scales='embed|layers/0/.*')
  with pytest.raises(ValueError, match='give them a learning rate'):
    make_qat_optimizer(prepare_qat(model, pol, learn_scales=True)[0], optax.adam(1e-3))
  with pytest.raises(ValueError, match='learn_scales=False'):
    prepare_qat(model, pol, ranges='mse')
  with pytest.raises(ValueError, match='activation format'):
    prepare_qat(model, pol, act=True)
  with pytest.raises(ValueError, match='policy makes it'):
    ptq, _ = quantize_model(model, _policy(int_format(8)))
    prepare_qat(ptq, pol)
  qat, _ = prepare_qat(model, pol)
  with pytest.raises(ValueError, match='trained as'):
    convert(qat, _policy(int_format(8)))
