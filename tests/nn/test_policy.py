"""Quantization policies: rule matching, reports, accuracy, bytes, Orbax round trip, QAT hook."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from qjax.core import QArray, dequantize, fp8_format, int_format
from qjax.nn import (QuantPolicy, QuantRule, QWeight, Transformer, TransformerConfig,
                     apply_fake_quant, model_report, quantize_model, weight_bytes)

INT8 = int_format(8)
INT4_G32 = int_format(4, group_size=32)


@pytest.fixture(scope='module')
def model():
  return Transformer(TransformerConfig.tiny(), rngs=nnx.Rngs(0))


@pytest.fixture(scope='module')
def tokens():
  return jax.random.randint(jax.random.key(1), (2, 12), 0, 256)


def _forward(m, tokens):
  return nnx.jit(lambda m, t: m(t))(m, tokens)


def _policy(*rules, **kw):
  return QuantPolicy(tuple(rules), **kw)


def test_first_match_wins_and_exempt(model):
  qm, rep = quantize_model(model, _policy(
      QuantRule(r'layers/0/attn/q_proj', INT4_G32),
      QuantRule(r'.*attn.*', INT8),
      QuantRule('embed', exempt=True),
      QuantRule(r'.*', INT8, granularity='tensor')))
  assert rep['layers/0/attn/q_proj'].weight == 'int4-g32-ch12'  # groups along D, per (N, H)
  assert rep['layers/1/attn/q_proj'].weight == 'int8-ch12'
  assert rep['layers/0/attn/o_proj'].weight == 'int8-ch2'  # contracts N, H: per output D
  assert rep['layers/0/mlp/up_proj'].weight == 'int8-tensor'
  assert rep['embed'].weight == 'float' and rep['embed'].reason == "exempt by rule 2 'embed'"
  assert rep.unused_rules == ()
  assert isinstance(qm.layers[0].attn.q_proj.w, QWeight) and qm.layers[0].attn.q_proj.quantized
  assert isinstance(qm.embed.w, nnx.Param)
  assert weight_bytes(model)['quantized'] == 0  # the float model is untouched
  assert 'int4-g32-ch12' in model_report(qm)


def test_no_rule_matched_keeps_float(model):
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    _, rep = quantize_model(model, _policy(QuantRule(r'.*mlp.*', INT8)))
  assert rep['layers/0/attn/k_proj'].weight == 'float'
  assert rep['layers/0/attn/k_proj'].reason == 'no rule matched'


def test_unused_rules_warn_and_strict_raises(model):
  typo = QuantRule(r'layers/\d+/atn/.*', INT8)
  with pytest.warns(UserWarning, match='matched no layer'):
    _, rep = quantize_model(model, _policy(QuantRule('.*mlp.*', INT8), typo))
  assert rep.unused_rules == (typo,)
  assert 'atn' in str(rep)
  with pytest.raises(ValueError, match=r"matched no layer.*atn"):
    quantize_model(model, _policy(QuantRule('.*mlp.*', INT8), typo, strict=True))


def test_group_size_not_dividing_a_layer_names_it(model):
  # o_proj contracts (N, H) = (4, 32); groups of 96 are neither within H nor whole rows of H
  # over N (groups of 64 are: the flattened contraction, tests/nn/test_quantize_layouts.py).
  with pytest.raises(ValueError, match=r"group_size=96 .* layer 'layers/0/attn/o_proj'.*"
                                       r'axis H has 32'):
    quantize_model(model, _policy(QuantRule('.*o_proj', int_format(4, group_size=96))))


@pytest.mark.parametrize('kw, match', [
    (dict(weight=int_format(8, channel_axes=(1,))), 'drop channel_axes'),
    (dict(), 'weight=None'),
    (dict(weight=INT8, exempt=True), 'exempt=True keeps layers float'),
    (dict(weight=INT8, granularity='row'), "granularity='row'"),
])
def test_rule_validation(kw, match):
  with pytest.raises(ValueError, match=match):
    QuantRule('.*', **kw)


def test_incompatible_compute_path_names_the_layer(model):
  with pytest.raises(ValueError, match="layer 'embed'.*path='int8' cannot multiply fp8e4m3"):
    quantize_model(model, _policy(QuantRule('.*', fp8_format()), path='int8'))
  with pytest.raises(ValueError, match="layer 'embed'.*int8-ch0 and activations fp8e4m3.*mix"):
    quantize_model(model, _policy(QuantRule('.*', INT8, act=fp8_format())))
  with pytest.raises(ValueError, match='already quantized'):
    quantize_model(quantize_model(model, _policy(QuantRule('.*', INT8)))[0],
                   _policy(QuantRule('.*', INT8)))


def test_int8_logits_close_int4_further_and_int4_bytes(model, tokens):
  ref = _forward(model, tokens)
  q8, _ = quantize_model(model, _policy(QuantRule('.*', INT8)))
  q4, rep4 = quantize_model(model, _policy(QuantRule('.*', INT4_G32)))
  err8 = float(jnp.abs(_forward(q8, tokens) - ref).max())
  err4 = float(jnp.abs(_forward(q4, tokens) - ref).max())
  scale = float(jnp.abs(ref).max())
  assert err8 < 0.1 * scale, (err8, scale)
  assert err4 > 3 * err8, (err4, err8)
  before, after = rep4.quantized_bytes()
  assert after < 0.3 * before, (after, before)
  wb = weight_bytes(q4)
  assert wb['quantized'] == rep4.bytes_after  # every Einsum quantized; norms stay float
  assert wb['float'] == weight_bytes(model)['total'] - rep4.bytes_before


def test_quantized_embedding_gathers_dequantized_rows(model, tokens):
  for gran in ('channel', 'tensor'):
    qm, _ = quantize_model(model, _policy(QuantRule('embed', INT4_G32, granularity=gran),
                                          strict=True))
    table = qm.embed.w.get_value()
    assert isinstance(table, QArray)
    np.testing.assert_array_equal(qm.embed.lookup(tokens, jnp.float32),
                                  dequantize(table)[tokens])


def test_orbax_round_trip_is_bit_identical(model, tokens, tmp_path):
  cfg = model.config
  policy = _policy(QuantRule(r'.*mlp.*', int_format(4, group_size=32, symmetric=False)),
                   QuantRule(r'.*attn.*', INT8, act=INT8),
                   QuantRule('embed', int_format(8, group_size=32)))
  qm, _ = quantize_model(model, policy)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / 'q', nnx.state(qm))
  ckpt.wait_until_finished()
  abstract = nnx.eval_shape(lambda: quantize_model(Transformer(cfg, rngs=nnx.Rngs(7)),
                                                   policy)[0])
  graphdef, abstract_state = nnx.split(abstract)
  restored = nnx.merge(graphdef, ckpt.restore(tmp_path / 'q', abstract_state))
  np.testing.assert_array_equal(_forward(restored, tokens), _forward(qm, tokens))


def test_fake_quant_sees_the_quantized_weights_and_trains(model, tokens):
  policy = _policy(QuantRule('embed', exempt=True), QuantRule('.*', INT4_G32))
  fm, rep = apply_fake_quant(model, policy)
  qm, _ = quantize_model(model, QuantPolicy(policy.rules, path='dequant'))
  np.testing.assert_allclose(_forward(fm, tokens), _forward(qm, tokens), atol=1e-4)
  assert rep.mode == 'fake_quant' and rep.bytes_after == rep.bytes_before
  assert rep['layers/0/mlp/up_proj'].weight == 'int4-g32-ch1'

  def loss(m):
    return jnp.mean(m(tokens) ** 2)
  grads = nnx.jit(nnx.grad(loss))(fm)
  g = grads['layers'][0]['attn']['q_proj']['w'].get_value()
  assert bool(jnp.isfinite(g).all()) and float(jnp.abs(g).max()) > 0
