"""Scales checked, NaN propagated under jit, ids and weights checked."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax.core import QFormat, dequantize, fake_quant, int_format, qeinsum, quantize
from qjax.nn import Transformer
from qjax.nn.transformer import check_token_ids

from reliability_lib import CFG


@pytest.mark.parametrize('x,fmt,expected', [
    ([1e6, 1.0], QFormat(bits=4, scale_dtype='float16'), r'is inf: it overflows float16'),
    ([1e-9, 0.0], QFormat(bits=8, scale_dtype='float16'), r'is 0: it underflows float16'),
    ([3e38, -3e38], QFormat(bits=8, symmetric=False), r'is inf: it overflows float32'),
])
def test_unrepresentable_scales_are_refused_naming_the_dtype(x, fmt, expected):
  with pytest.raises(ValueError, match=expected) as e:
    quantize(jnp.asarray(x, jnp.float32), fmt)
  assert f'scale_dtype {fmt.scale_dtype}' in str(e.value)


def test_fake_quant_refuses_the_same_scales():
  with pytest.raises(ValueError, match=r'overflows float16'):
    fake_quant(jnp.asarray([1e6, 1.0]), QFormat(bits=4, scale_dtype='float16'))


@pytest.mark.parametrize('lo,hi,expected', [
    (np.nan, np.nan, r'the range \(nan, nan\) .* is not finite'),
    (1.0, -1.0, r'hi=-1.0 < lo=1.0'),
])
@pytest.mark.parametrize('fn', [quantize, fake_quant], ids=['quantize', 'fake_quant'])
def test_bad_explicit_ranges_are_refused(fn, lo, hi, expected):
  r = (jnp.full((1,), lo, jnp.float32), jnp.full((1,), hi, jnp.float32))
  with pytest.raises(ValueError, match=expected):
    fn(jnp.ones(4), QFormat(), r)


FMT = QFormat(bits=8, channel_axes=(0,))
X = jnp.asarray([[1.0, 2.0, np.nan, 4.0], [1.0, 2.0, 3.0, 4.0]])


@pytest.mark.parametrize('name,fn', [
    ('fake_quant', lambda x: fake_quant(x, FMT)),
    ('fake_quant_learned_scale', lambda x: fake_quant(x, FMT, scale=jnp.full((2, 1), 0.05))),
    ('quantize_dequantize', lambda x: dequantize(quantize(x, FMT))),
    # KV-style: one scale per token and head, as the cache quantizes on write.
    ('kv_style', lambda x: dequantize(quantize(x[None], QFormat(bits=8, channel_axes=(0, 1))))[0]),
])
def test_nan_propagates_under_jit(name, fn):
  y = np.asarray(jax.jit(fn)(X))
  assert np.isnan(y[0, 2]), name            # the NaN itself is never a plausible number
  assert np.isfinite(y[1]).all(), name      # other scales' tiles are untouched
  np.testing.assert_allclose(y[1], [1, 2, 3, 4], atol=0.05)


@pytest.mark.parametrize('path,act', [('int8', int_format(8)), ('tiled', None)])
def test_nan_activation_reaches_the_output_of_a_jitted_qeinsum(path, act):
  # W8A8 quantizes activations per row under jit: a NaN row must stay NaN, not become codes.
  w = quantize(jnp.linspace(-1, 1, 4 * 8).reshape(4, 8), int_format(8, channel_axes=(1,)))
  f = jax.jit(lambda x: qeinsum('MD,DF->MF', x, w, act_fmt=act, path=path))
  y = np.asarray(f(X))
  assert np.isnan(y[0]).all(), path
  np.testing.assert_allclose(y[1], np.asarray(X[1]) @ np.asarray(dequantize(w)), rtol=0.02,
                             atol=0.02)


def test_nan_propagates_through_a_jitted_qat_forward(model):
  from qjax.nn import QuantPolicy, QuantRule, apply_fake_quant  # pylint: disable=g-import-not-at-top
  m = nnx.clone(model)
  m.embed.w.set_value(m.embed.w.get_value().at[5].set(jnp.nan))  # a NaN activation enters
  policy = QuantPolicy((QuantRule('embed', exempt=True),
                        QuantRule('.*', int_format(8), act=QFormat(bits=8))))
  qat, _ = apply_fake_quant(m, policy)
  logits = np.asarray(nnx.jit(lambda m, t: m(t))(qat, jnp.asarray([[1, 5, 2]], jnp.int32)))
  assert np.isnan(logits[0, 1]).all()   # never replaced by plausible numbers


def test_eager_quantize_reports_nan():
  with pytest.raises(ValueError, match=r'holds 1 NaN/Inf values \(first at index \(0, 2\)\)'):
    quantize(X, FMT)


@pytest.mark.parametrize('fn', [quantize, fake_quant], ids=['quantize', 'fake_quant'])
def test_integer_input_is_refused(fn):
  with pytest.raises(ValueError, match=r'expected a floating tensor, got dtype int32'):
    fn(jnp.arange(8, dtype=jnp.int32), QFormat())


@pytest.mark.parametrize('fn', [quantize, fake_quant], ids=['quantize', 'fake_quant'])
def test_empty_input_is_refused(fn):
  with pytest.raises(ValueError, match=r'empty tensor of shape \(0, 4\)'):
    fn(jnp.zeros((0, 4)), QFormat())


@pytest.fixture(scope='module')
def model():
  return Transformer(CFG, rngs=nnx.Rngs(0))


@pytest.mark.parametrize('bad', [CFG.vocab_size, -1, 10_000])
def test_out_of_vocabulary_ids_are_refused(model, bad):
  tokens = jnp.asarray([[1, 2, bad]], jnp.int32)
  with pytest.raises(ValueError, match=rf'token id {bad} at index \(0, 2\) is outside the '
                                       rf'vocabulary \[0, {CFG.vocab_size}\)'):
    model(tokens)


def test_float_ids_are_refused(model):
  with pytest.raises(ValueError, match=r'token ids must be integers, got dtype float32'):
    check_token_ids(jnp.asarray([[1.0]]), CFG.vocab_size)


def test_in_vocabulary_ids_pass(model):
  assert model(jnp.asarray([[0, CFG.vocab_size - 1]], jnp.int32)).shape == (1, 2, 64)


def test_quantize_model_checks_the_jitted_scales(model):
  from qjax.nn import QuantPolicy, QuantRule, quantize_model  # pylint: disable=g-import-not-at-top
  m = nnx.clone(model)
  w = m.layers[0].mlp.up_proj.w
  w.set_value(w.get_value().at[0, 0].set(1e6))
  policy = QuantPolicy((QuantRule('layers/0/mlp/up_proj', int_format(4, scale_dtype='float16')),))
  with pytest.raises(ValueError, match=r"layer 'layers/0/mlp/up_proj'.*overflows float16"):
    quantize_model(m, policy)
