"""qjax.pipeline.gemma, the Gemma PTQ sweep's pieces, on a tiny model: windows, metrics."""

import numpy as np
import pytest
from flax import nnx

from qjax.algorithms import apply_method
from qjax.core import dequantize, int_format
from qjax.nn import QuantPolicy, QuantRule, Transformer, TransformerConfig, einsum_layers
from qjax.pipeline import gemma as gemma_ptq

POLICY = QuantPolicy((QuantRule('embed', exempt=True),
                      QuantRule('.*', int_format(3, group_size=32))))


@pytest.fixture(scope='module')
def model():
  return Transformer(TransformerConfig.tiny(tie_embeddings=True), rngs=nnx.Rngs(0))


def _types(model):
  # Pretend source types: attention 'Q4_K', MLP 'Q5_0' (as a GGUF loader reports them).
  return {f'{p}/w': ('Q4_K' if '/attn/' in p else 'Q5_0') for p, _ in einsum_layers(model)}


def test_bos_windows():
  ids = np.arange(100, 140, dtype=np.int32)
  w = gemma_ptq.bos_windows(ids, 2, 8, 3)
  assert w.shape == (3, 8) and (w[:, 0] == 2).all()
  np.testing.assert_array_equal(w[1, 1:], ids[9:16])
  with pytest.raises(ValueError, match='fewer than 6 windows of 8'):
    gemma_ptq.bos_windows(ids, 2, 8, 6)


def test_rtn_weight_error_per_source_type(model):
  q, _, rec = apply_method(model, POLICY, 'rtn', None)
  out = gemma_ptq.per_source_type(model, _types(model))(q, rec)['by_source_type']
  assert set(out) == {'Q4_K', 'Q5_0'}
  assert out['Q4_K']['layers'] == 2 * 4 and out['Q5_0']['layers'] == 2 * 3
  # Independently: the mean relative error of the attention layers.
  errs = []
  for (p, lq), (_, lf) in zip(einsum_layers(q), einsum_layers(model)):
    if '/attn/' in p:
      wf = np.asarray(lf.w.get_value())
      errs.append(np.linalg.norm(np.asarray(dequantize(lq.w.get_value())) - wf) /
                  np.linalg.norm(wf))
  assert out['Q4_K']['rel_weight_err'] == pytest.approx(np.mean(errs), rel=1e-5)
  assert out['Q4_K']['output_err_vs_rtn'] is None


def test_gptq_output_error_relative_to_rtn_per_source_type(model):
  tokens = np.random.default_rng(0).integers(0, 256, (8, 32)).astype(np.int32)
  q, _, rec = apply_method(model, POLICY, 'gptq', tokens, {'batch_size': 4})
  out = gemma_ptq.per_source_type(model, _types(model))(q, rec)['by_source_type']
  for kind in ('Q4_K', 'Q5_0'):
    assert 0.0 < out[kind]['output_err_vs_rtn'] < 1.0  # GPTQ's objective, below RTN's
  table = gemma_ptq.source_type_table([{'name': 'gptq-x', 'by_source_type': out}])
  assert '| gptq-x | Q4_K | 8 |' in table
