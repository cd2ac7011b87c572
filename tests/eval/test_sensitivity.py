"""qjax.eval.sensitivity: per-layer sensitivity, the fallback policy, mixed precision."""

import itertools

import numpy as np
import pytest
from flax import nnx

from qjax.core import int_format
from qjax.eval import sensitivity as S
from qjax.nn import Transformer, TransformerConfig, einsum_layers, quantize_model, weight_bytes

FORMATS = {'int8': int_format(8), 'int3-g32': int_format(3, group_size=32)}


@pytest.fixture(scope='module')
def setup():
  model = Transformer(TransformerConfig.tiny(), rngs=nnx.Rngs(0))
  tokens = np.random.default_rng(0).integers(0, 256, (2, 32))
  before = {p: np.asarray(l.w.get_value()) for p, l in einsum_layers(model)}
  sens = S.layer_sensitivity(model, tokens, FORMATS)
  return model, tokens, sens, before


def test_sensitivity_orders_formats_and_restores_the_model(setup):
  model, _, sens, before = setup
  assert set(sens['kl']) == {p for p, _ in einsum_layers(model)}
  for p, s in sens['kl'].items():
    assert 0 <= s['int8'] < s['int3-g32'], (p, s)
  for p, l in einsum_layers(model):  # the float model was rounded in place and restored
    np.testing.assert_array_equal(np.asarray(l.w.get_value()), before[p])


def test_sensitivity_equals_the_kl_of_the_real_quantized_model(setup):
  model, tokens, sens, _ = setup
  path = 'layers/1/mlp/up_proj'
  policy = S.policy_from_assignment({path: 'int3-g32'}, FORMATS)
  qmodel, _ = quantize_model(model, policy)
  kl = S.model_kl(qmodel, tokens, S.reference_logp(model, tokens))
  # Same rounded weights; the quantized model multiplies codes by scales in its own order.
  np.testing.assert_allclose(kl, sens['kl'][path]['int3-g32'], rtol=1e-2)


def test_fallback_reaches_its_threshold_and_reports_the_trigger_rate(setup):
  model, tokens, sens, _ = setup
  fb = S.fallback(model, tokens, base='int3-g32', high='int8', threshold=0.02,
                  sensitivity=sens, formats=FORMATS)
  assert fb['reached'] and fb['kl'] <= 0.02
  ks, kls = zip(*fb['trajectory'])
  assert kls[0] > 0.02 and list(ks) == list(range(len(ks)))
  fell = fb['trigger_rate']['fell_back']
  assert len(fell) == ks[-1] and 0 < fb['trigger_rate']['layers'] < 1
  # The most sensitive layers fell back first.
  order = sorted(sens['kl'], key=lambda p: -sens['kl'][p]['int3-g32'])
  assert set(fell) == set(order[:len(fell)])
  # Trigger rates recomputed from the quantized model's layers.
  qmodel, report = quantize_model(model, fb['policy'])
  by_path = {l.path: l for l in report.layers}
  total_b = sum(l.bytes_after for l in report.layers)
  np.testing.assert_allclose(fb['trigger_rate']['bytes'],
                             sum(by_path[p].bytes_after for p in fell) / total_b)
  total_p = sum(np.prod(l.shape) for l in report.layers)
  np.testing.assert_allclose(fb['trigger_rate']['params'],
                             sum(np.prod(by_path[p].shape) for p in fell) / total_p)
  kl = S.model_kl(qmodel, tokens, S.reference_logp(model, tokens))
  np.testing.assert_allclose(kl, fb['kl'], rtol=1e-2)


def test_mixed_precision_never_exceeds_the_budget_and_uses_it(setup):
  model, _, sens, _ = setup
  nbytes = S.layer_bytes(model, FORMATS)
  lo = S.assignment_bytes(S.uniform_assignment(model, 'int3-g32', FORMATS), nbytes)
  hi = S.assignment_bytes(S.uniform_assignment(model, 'int8', FORMATS), nbytes)
  prev = None
  for budget in np.linspace(lo, hi, 9).astype(int):
    mp = S.mixed_precision(sens['kl'], nbytes, int(budget))
    assert mp['bytes'] <= budget
    assert mp['bytes'] == S.assignment_bytes(mp['assignment'], nbytes)
    qmodel, _ = quantize_model(model, S.policy_from_assignment(mp['assignment'], FORMATS))
    float_rest = weight_bytes(qmodel)['float']
    assert weight_bytes(qmodel)['total'] - float_rest == mp['bytes']  # measured bytes
    if prev is not None:
      assert mp['predicted_kl'] <= prev + 1e-12  # more bytes never predict worse
    prev = mp['predicted_kl']
  assert S.mixed_precision(sens['kl'], nbytes, hi)['assignment'] == {
      p: 'int8' for p in sens['kl']}
  with pytest.raises(ValueError, match='below the smallest'):
    S.mixed_precision(sens['kl'], nbytes, lo - 1)


def test_mixed_precision_on_random_tables_respects_budget_and_beats_uniform():
  rng = np.random.default_rng(0)
  for _ in range(30):
    layers = [f'l{i}' for i in range(4)]
    nbytes = {p: {'a': 1 * int(rng.integers(1, 5)), 'b': int(rng.integers(5, 9)),
                  'c': int(rng.integers(9, 14))} for p in layers}
    sens = {p: {'a': float(rng.uniform(2, 4)), 'b': float(rng.uniform(0.5, 2)),
                'c': float(rng.uniform(0, 0.5))} for p in layers}
    budget = int(rng.integers(sum(v['a'] for v in nbytes.values()),
                              sum(v['c'] for v in nbytes.values()) + 1))
    mp = S.mixed_precision(sens, nbytes, budget)
    assert mp['bytes'] <= budget
    feasible = [sum(sens[p][f] for p, f in zip(layers, combo))
                for combo in itertools.product('abc', repeat=4)
                if sum(nbytes[p][f] for p, f in zip(layers, combo)) <= budget]
    # Brute force: the solver finds the optimum (a budget this small is solved byte by byte).
    assert mp['predicted_kl'] == pytest.approx(min(feasible))
    for f in 'abc':  # never worse than a uniform format that fits
      if sum(nbytes[p][f] for p in layers) <= budget:
        assert mp['predicted_kl'] <= sum(sens[p][f] for p in layers) + 1e-12
