"""qjax.eval.memory: the planner's predictions against the device bytes of built models."""

import dataclasses

import jax
import pytest
from flax import nnx

from qjax.core import int_format
from qjax.eval import memory
from qjax.nn import (QuantPolicy, QuantRule, Transformer, TransformerConfig, init_cache,
                     quantize_model)

CFG = TransformerConfig.tiny()
POLICIES = {
    'float': None,
    'int8': QuantPolicy((QuantRule('.*', int_format(8)),)),
    'int4-g32': QuantPolicy((QuantRule('.*', int_format(4, group_size=32)),)),
    'int3-g32 asym, embed float': QuantPolicy((
        QuantRule('embed', exempt=True),
        QuantRule('.*', int_format(3, group_size=32, symmetric=False)))),
}


@pytest.fixture(scope='module')
def model():
  return Transformer(CFG, rngs=nnx.Rngs(0))


@pytest.mark.parametrize('name', list(POLICIES))
def test_weight_and_kv_prediction_within_5_percent_of_device_bytes(model, name):
  policy = POLICIES[name]
  qmodel = model if policy is None else quantize_model(model, policy)[0]
  pred = memory.predict(CFG, policy, batch=3, context=40, prompt=8)
  meas = memory.measure(qmodel, batch=3, context=40, compiled=False)
  w = pred.weights
  assert w['codes'] + w['scales'] + w['zero_points'] + w['float'] == w['total']
  assert abs(w['total'] / meas['weights']['total'] - 1) <= 0.05
  assert abs(w['float'] / max(meas['weights']['float'], 1) - 1) <= 0.05
  assert abs(pred.kv / meas['kv'] - 1) <= 0.05
  if policy is not None:
    assert w['codes'] > 0 and w['scales'] > 0
    assert (w['zero_points'] > 0) == ('asym' in name)
    assert w['total'] < memory.weight_bytes(CFG)['total']


def test_quantized_kv_prediction_matches_the_cache():
  got = memory.kv_bytes(CFG, 2, 16, 'int8')
  cache = init_cache(CFG, 2, 16, fmt='int8')
  assert got == memory._device_bytes(cache)
  assert got < memory.kv_bytes(CFG, 2, 16)  # int8 codes + scales < float32


def test_seed_kv_formula_golden():
  # 2 * L * K * H * T * bytes, + 4 bytes of length per row: 2 * 2 * 2 * 32 * 10 * 4 + 4.
  assert memory.kv_bytes(CFG, 1, 10) == 2 * 2 * 2 * 32 * 10 * 4 + 4


def test_what_fits_is_consistent_with_predict():
  budget = 400_000
  out = memory.what_fits(CFG, budget, {k: POLICIES[k] for k in ('float', 'int4-g32')},
                         batch=1, context=64)
  for name, r in out.items():
    policy = POLICIES[name]
    if r['max_batch']:
      assert memory.predict(CFG, policy, batch=r['max_batch'], context=64,
                            prompt=1).total <= budget
    assert memory.predict(CFG, policy, batch=r['max_batch'] + 1, context=64,
                          prompt=1).total > budget
  assert out['int4-g32']['max_batch'] > out['float']['max_batch']
  assert out['int4-g32']['weights'] < out['float']['weights']


def test_bad_workload_is_refused():
  with pytest.raises(ValueError, match='context=65 exceeds'):
    memory.predict(CFG, batch=1, context=65)
  with pytest.raises(ValueError, match='budget_bytes'):
    memory.what_fits(CFG, 0, {'f': None})


def test_compiled_prediction_is_what_xla_allocates_for_the_built_model(model):
  # The step compiled from shapes alone (no weights) against the same step of built models.
  policy = POLICIES['int4-g32']
  qmodel = quantize_model(model, policy)[0]
  for tokens in (1, 8):
    got = memory.compiled_step_bytes(CFG, policy, batch=2, tokens=tokens, context=40)
    assert got == memory.compiled_memory(qmodel, 2, tokens, 40), tokens
  pred = memory.predict(CFG, policy, batch=2, context=40, prompt=8, compiled=True)
  decode = memory.compiled_memory(qmodel, 2, 1, 40)
  assert pred.decode_activations == decode['temp'] + decode['output'] - decode['alias']


def test_compiled_max_context_fits_and_one_more_does_not():
  policy = POLICIES['int4-g32']
  budget = memory.predict(CFG, policy, batch=1, context=48, prompt=1, compiled=True).total
  s = memory.max_context(CFG, budget, policy, compiled=True)
  assert s >= 48
  assert memory.predict(CFG, policy, batch=1, context=s, prompt=1, compiled=True).total <= budget
  if s < CFG.max_len:
    assert memory.predict(CFG, policy, batch=1, context=s + 1, prompt=1,
                          compiled=True).total > budget
  with pytest.raises(ValueError, match='pass the policy instead of formats'):
    memory.predict(CFG, batch=1, context=8, compiled=True, formats={})


def test_kv_prediction_follows_the_sliding_window_ring():
  cfg = TransformerConfig.tiny(max_len=256, num_layers=3, sliding_window=16, global_every=3)
  # Below / above window + slack (16 + 64): rings only where shorter than the context.
  for ctx, fmt in ((40, None), (200, None), (200, 'int8')):
    got = memory.kv_bytes(cfg, 2, ctx, fmt)
    assert got == memory._device_bytes(init_cache(cfg, 2, ctx, fmt=fmt)), (ctx, fmt)
  assert memory.kv_bytes(cfg, 2, 40) == memory.kv_bytes(cfg, 2, 40, ring=False)
  # 2 of 3 layers hold 80 slots instead of 200: golden from the layout.
  assert memory.kv_bytes(cfg, 1, 200, ring=False) - memory.kv_bytes(cfg, 1, 200) == (
      2 * 2 * (200 - 80) * cfg.num_kv_heads * cfg.head_dim * 4)



def test_device_memory_is_none_on_cpu_and_a_dict_on_an_accelerator():
  from qjax.eval import process  # pylint: disable=g-import-not-at-top
  stats = process.device_memory()
  if jax.default_backend() == 'cpu':
    assert stats is None
  else:  # GPU / TPU keep statistics: bytes in use, the running peak, the limit
    assert stats['in_use'] > 0 and stats['peak'] >= stats['in_use'], stats
  assert process.device_memory(jax.devices('cpu')[0]) is None


def test_prefill_scores_follow_the_attention_form_of_the_platform():
  """'auto' is dense on CPU (T x S scores) and a fused kernel on NVIDIA (bf16) and TPU (no
  scores held); a decode step and an explicit 'dense' are the same everywhere."""
  cfg = dataclasses.replace(CFG, dtype='bfloat16')
  b, t, s = 2, 48, 64
  est = {on: memory.activation_bytes(cfg, b, t, s, on=on) for on in ('cpu', 'nvidia', 'tpu')}
  assert est['cpu'] - est['nvidia'] == b * cfg.num_heads * t * (s - 1) * 4
  assert est['nvidia'] == est['tpu']
  dense = dataclasses.replace(cfg, attention_impl='dense')
  assert len({memory.activation_bytes(dense, b, t, s, on=on) for on in est}) == 1
  assert len({memory.activation_bytes(cfg, b, 1, s, on=on) for on in est}) == 1
  # f32 queries on NVIDIA: cuDNN cannot take them; a short prompt runs dense.
  assert memory.activation_bytes(CFG, b, t, s, on='nvidia') == memory.activation_bytes(
      CFG, b, t, s, on='cpu')
  pred = {on: memory.predict(cfg, batch=b, context=s, prompt=t, on=on) for on in est}
  assert pred['cpu'].prefill_activations > pred['nvidia'].prefill_activations
  assert pred['cpu'].decode_activations == pred['nvidia'].decode_activations
