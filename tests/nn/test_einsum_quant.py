"""EinsumQuant: one frozen description per Einsum, the variables it implies, its forward."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax.core import int_format, quantize
from qjax.nn import Einsum, EinsumQuant, QWeight

SPEC = 'BTD,DF->BTF'
INT8_F = int_format(8, channel_axes=(1,), group_axis=0)  # one scale per output channel
X = jax.random.normal(jax.random.key(1), (2, 3, 8))


def _layer():
  return Einsum(SPEC, (8, 4), ('embed', 'mlp'), rngs=nnx.Rngs(0))


def _quantized(fmt=INT8_F):
  layer = _layer()
  layer.w = QWeight(quantize(layer.w[...], fmt), logical_axes=layer.axes)
  return layer


@pytest.mark.parametrize('kw,match', [
    ({'path': 'int4'}, "path='int4' is unknown"),
    ({'learn_scale': True}, 'fake_fmt=None'),
    ({'fake_act_fmt': int_format(8)}, 'without fake_fmt'),
    ({'outlier_threshold': -1.0}, 'must be >= 0'),
    ({'outlier_weights': 'fp16'}, "outlier_weights='fp16' is unknown"),
    ({'act_fmt': 'int8'}, "act_fmt='int8' is not a QFormat"),
])
def test_bad_descriptions_are_refused(kw, match):
  with pytest.raises(ValueError, match=match):
    EinsumQuant(**kw)


def test_variables_follow_the_description():
  assert EinsumQuant().variables == ()
  q = EinsumQuant(fake_fmt=int_format(4, symmetric=False), learn_scale=True, pact=True)
  assert q.variables == ('qat_scale', 'qat_zero_point', 'act_clip')
  assert q.replace(fake_fmt=int_format(4)).variables == ('qat_scale', 'act_clip')
  llm = EinsumQuant(outlier_threshold=6, input_scale=True)
  assert llm.outlier_threshold == 6.0 and llm.variables == ('in_scale', 'w_outlier')
  assert llm.replace(outlier_weights='int8').variables == ('in_scale',)


def test_to_dict_round_trips_through_json():
  q = EinsumQuant(fake_fmt=int_format(4, group_size=16, channel_axes=(1,)), learn_scale=True,
                  fake_act_fmt=int_format(8, channel_axes=(0, 1)), pact=True)
  back = EinsumQuant.from_dict(json.loads(json.dumps(q.to_dict())))
  assert back == q and hash(back) == hash(q)
  with pytest.raises(ValueError, match=r"unknown fields \['hqq'\]"):
    EinsumQuant.from_dict({**q.to_dict(), 'hqq': 1})


def test_a_description_that_adds_a_variable_needs_its_value():
  layer = _layer()
  with pytest.raises(ValueError, match="adds the variable 'act_clip'.*pass act_clip="):
    layer.quant = EinsumQuant(pact=True)
  with pytest.raises(ValueError, match=r"values \['in_scale'\] given"):
    layer.set_quant(EinsumQuant(pact=True), act_clip=1.0, in_scale=jnp.ones(8))
  with pytest.raises(ValueError, match=r'in_scale of Einsum .* shape \(4,\), expected \(8,\)'):
    layer.set_quant(EinsumQuant(input_scale=True), in_scale=jnp.ones(4))
  assert layer.quant == EinsumQuant() and layer.act_clip is None  # failed calls change nothing


def test_pact_clip_and_input_scale_in_the_forward():
  layer = _layer()
  w = np.asarray(layer.w[...])
  s = np.linspace(0.5, 2.0, 8).astype(np.float32)
  layer.set_quant(EinsumQuant(pact=True, input_scale=True), act_clip=1.0, in_scale=s)
  want = np.einsum('btd,df->btf', np.clip(np.asarray(X), -1.0, 1.0) / s, w)
  np.testing.assert_allclose(layer(X), want, rtol=1e-5, atol=1e-6)
  state = nnx.state(layer)
  assert float(state['act_clip'][...]) == 1.0 and state['in_scale'][...].shape == (8,)
  # Replacing the description drops what it no longer implies, and keeps what it still does.
  layer.quant = layer.quant.replace(input_scale=False)
  assert layer.in_scale is None and 'in_scale' not in nnx.state(layer)
  assert float(layer.act_clip[...]) == 1.0


def test_serving_and_training_fields_need_the_right_weight():
  with pytest.raises(ValueError, match=r"float weight.*\['act_fmt'\].*quantize the layer"):
    _layer().set_quant(EinsumQuant(act_fmt=int_format(8)))
  with pytest.raises(ValueError, match=r"quantized weight \(int8.*\['fake_fmt'\]"):
    _quantized().set_quant(EinsumQuant(fake_fmt=INT8_F))
  with pytest.raises(ValueError, match='LLM.int8.*needs int8 weights, not int4'):
    _quantized(int_format(4, channel_axes=(1,), group_axis=0)).set_quant(
        EinsumQuant(outlier_threshold=6.0, outlier_weights='int8'))


def test_llm_int8_threshold_zero_is_the_float_layer():
  layer = _quantized()
  w = _layer().w[...]  # the same float weight (same rngs)
  layer.set_quant(EinsumQuant(outlier_threshold=0.0), w_outlier=w)
  np.testing.assert_array_equal(layer(X), jnp.einsum(SPEC, X, w))
  y, int8_fraction = layer.outlier_forward(X, layer.w.get_value())
  assert float(int8_fraction) == 0.0


def test_placeholder_values_have_the_variables_shapes():
  layer = _layer()
  q = EinsumQuant(fake_fmt=int_format(4, symmetric=False, channel_axes=(1,), group_axis=0),
                  learn_scale=True, pact=True, input_scale=True)
  values = layer.placeholder_values(q)
  assert sorted(values) == ['act_clip', 'in_scale', 'qat_scale', 'qat_zero_point']
  assert values['in_scale'].shape == (8,) and values['act_clip'].shape == ()
  layer.set_quant(q, **values)
  assert layer.qat_scale[...].shape == layer.qat_zero_point[...].shape
