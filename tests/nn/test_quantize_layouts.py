"""`quantize_model(layout=...)` and groups along the flattened contraction, on a tiny model
shaped like a head_dim-64 model at g128 (head_dim 16, groups of 32: o_proj's (N, H, D) weight
is grouped over N*H, two heads per group)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qjax
from qjax.algorithms import apply_method
from qjax.core import int_format, quantize
from qjax.nn import (QuantPolicy, QuantRule, Transformer, TransformerConfig, einsum_layers,
                     quantize_model, relayout_model)

CFG = TransformerConfig.tiny(num_layers=1, head_dim=16, num_heads=4, num_kv_heads=2)
G32 = int_format(4, group_size=32)


@pytest.fixture(scope='module')
def model():
  return Transformer(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope='module')
def tokens():
  return jax.random.randint(jax.random.key(1), (2, 8), 0, CFG.vocab_size)


def _logits(m, tokens):
  return nnx.jit(lambda m, t: m(t))(m, tokens)


def test_o_proj_groups_run_along_the_flattened_heads(model, tokens):
  qm, rep = quantize_model(model, QuantPolicy((QuantRule('.*', G32),)))
  layers = dict(einsum_layers(qm))
  q = layers['layers/0/attn/o_proj'].w.get_value()
  assert q.shape == (4, 16, 64) and q.tile_shape == (2, 16, 1)
  w = dict(einsum_layers(model))['layers/0/attn/o_proj'].w.get_value()
  # The same numbers as the (N*H, D) matrix grouped by 32 along N*H.
  ref = quantize(w.reshape(64, 64), int_format(4, group_size=32, channel_axes=(1,)))
  np.testing.assert_array_equal(q.dequantize().reshape(64, 64), ref.dequantize())
  assert rep.layers[[l.path for l in rep.layers].index('layers/0/attn/o_proj')].weight == (
      'int4-g32-ch2')
  # Through the forward: the float model holding the dequantized weights, and every path.
  twin = nnx.clone(model)
  for path, layer in einsum_layers(twin):
    w_float = layer.w.get_value()
    layer.w.set_value(layers[path].w.get_value().dequantize(w_float.dtype))
  y_ref = _logits(twin, tokens)
  for path in ('dequant', 'native'):
    qp, _ = quantize_model(model, QuantPolicy((QuantRule('.*', G32),), path=path))
    np.testing.assert_allclose(_logits(qp, tokens), y_ref, rtol=1e-4, atol=1e-4)
  assert float(qjax.sqnr_db(y_ref, _logits(qm, tokens))) > 40.0  # CPU auto: bf16 tiles


def test_native_layout_model_equals_packed(model, tokens):
  rules = (QuantRule('.*', G32),)
  packed, _ = quantize_model(model, QuantPolicy(rules, path='dequant'), layout='packed')
  native, _ = quantize_model(model, QuantPolicy(rules, path='native'), layout='native')
  for (_, a), (_, b) in zip(einsum_layers(packed), einsum_layers(native)):
    qa, qb = a.w.get_value(), b.w.get_value()
    assert qa.data.dtype == jnp.uint8 and qb.data.dtype == jnp.int4
    np.testing.assert_array_equal(qa.codes(), qb.codes())
  np.testing.assert_allclose(_logits(native, tokens), _logits(packed, tokens),
                             rtol=1e-5, atol=1e-5)
  back = relayout_model(native, 'packed')
  assert all(l.w.get_value().data.dtype == jnp.uint8 for _, l in einsum_layers(back))
  with pytest.raises(ValueError, match="layout='int4' is unknown"):
    quantize_model(model, QuantPolicy(rules), layout='int4')


def test_groups_that_are_not_whole_rows_of_heads_raise(model):
  with pytest.raises(ValueError, match=r"group_size=48 .*layers/0/attn/o_proj.*whole rows of H"):
    quantize_model(model, QuantPolicy((QuantRule('.*o_proj', int_format(4, group_size=48)),)))


def test_apply_method_returns_the_requested_layout(model):
  qm, _, record = apply_method(model, QuantPolicy((QuantRule('.*mlp.*', G32),)), 'rtn', None,
                               layout='native')
  assert record['method'] == 'rtn'
  assert {l.w.get_value().qtype.layout for _, l in einsum_layers(qm) if l.quantized} == {
      'native'}


def test_gptq_fits_groups_that_span_heads(model):
  tokens = jax.random.randint(jax.random.key(0), (8, 16), 0, CFG.vocab_size)
  qm, _, record = apply_method(model, QuantPolicy((QuantRule('.*o_proj', G32),)), 'gptq',
                               tokens)
  q = dict(einsum_layers(qm))['layers/0/attn/o_proj'].w.get_value()
  assert q.tile_shape == (2, 16, 1)
  fit = record['layers']['layers/0/attn/o_proj']
  assert fit['output_error'] < 0.7 * fit['rtn_output_error']  # GPTQ beats RTN on its groups


def test_greedy_decode_of_native_and_packed_models_agree(model, tokens):
  from qjax.nn import generate, init_cache, kv_format  # pylint: disable=import-outside-toplevel
  rules = (QuantRule('.*', G32),)
  out = {}
  for layout, path in (('packed', 'dequant'), ('native', 'native')):
    qm, _ = quantize_model(model, QuantPolicy(rules, path=path), layout=layout)
    cache = init_cache(CFG, 2, 16, fmt=kv_format(qm))
    tok, cache = generate.greedy_step(qm, tokens[:, :4], cache)
    seq = [tok]
    for _ in range(3):
      tok, cache = generate.greedy_step(qm, tok[:, None], cache)
      seq.append(tok)
    out[layout] = np.stack(seq, 1)
  np.testing.assert_array_equal(out['native'], out['packed'])


def test_a_model_on_the_pallas_path_gives_the_dequantized_logits(model, tokens, monkeypatch):
  from qjax.kernels import pallas_qmm  # pylint: disable=import-outside-toplevel
  calls = []
  kernel = pallas_qmm.qmm
  monkeypatch.setattr(pallas_qmm, 'qmm', lambda *a, **k: calls.append(k['bits']) or kernel(*a, **k))
  rules = (QuantRule('.*', int_format(8)), QuantRule('.*', G32))
  for rule in rules:  # int8 per-channel and int4 g32 (packed: the kernel's int4 layout)
    ref, _ = quantize_model(model, QuantPolicy((rule,), path='dequant'), layout='packed')
    qp, _ = quantize_model(model, QuantPolicy((rule,), path='pallas'), layout='packed')
    np.testing.assert_allclose(_logits(qp, tokens), _logits(ref, tokens), rtol=1e-4, atol=1e-4)
  # q, k, v, o, gate, up, down per layer ran on the kernel (the tied head takes 'auto').
  assert calls.count(8) == 7 * CFG.num_layers and calls.count(4) == 7 * CFG.num_layers
