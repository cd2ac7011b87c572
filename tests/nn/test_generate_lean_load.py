"""Serving a quantized model without the float one: `quantize_streamed` from a lazy cache entry
equals `quantize_model` of the loaded float model (codes, scales, descriptions, logits)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax.checkpoints import model_params, param_cache, quantized
from qjax.core import int_format
from qjax.nn import (QuantPolicy, QuantRule, Transformer, TransformerConfig, einsum_layers,
                     quantize_model)

GEMMA_LIKE = dict(qk_norm=True, post_norms=True, tie_embeddings=True)
CFG = TransformerConfig.tiny(**GEMMA_LIKE)


@pytest.fixture(scope='module')
def entry(tmp_path_factory):
  model = Transformer(CFG, rngs=nnx.Rngs(3))
  path = tmp_path_factory.mktemp('cache') / 'params.safetensors'
  param_cache.save_params(path, model_params(model), {'config': {}})
  return model, param_cache.LazyParams(path)


@pytest.mark.parametrize('policy', [
    QuantPolicy((QuantRule('.*', int_format(4, group_size=16)),)),
    QuantPolicy((QuantRule('embed', exempt=True), QuantRule('.*', int_format(8)))),
], ids=['int4-g16-all', 'int8-head-float'])
def test_streamed_equals_quantize_model(entry, policy, monkeypatch):
  model, lazy = entry
  # Blocks of 60 embedding rows (256 rows: the last block is short): the block path runs.
  monkeypatch.setattr(quantized, '_STREAM_BLOCK_ELEMENTS', 60 * CFG.d_model)
  want, want_report = quantize_model(model, policy)
  got, got_report = quantized.quantize_streamed(CFG, lazy, policy)
  assert jax.tree.structure(nnx.state(got)) == jax.tree.structure(nnx.state(want))
  for a, b in zip(jax.tree.leaves(nnx.state(got)), jax.tree.leaves(nnx.state(want))):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert {p: l.quant for p, l in einsum_layers(got)} == {p: l.quant for p, l in
                                                          einsum_layers(want)}
  assert got_report.layers == want_report.layers
  tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
  np.testing.assert_array_equal(np.asarray(got(tokens)), np.asarray(want(tokens)))


def test_streamed_refuses_a_mismatched_entry(entry):
  _, lazy = entry
  with pytest.raises(ValueError, match=r'missing .*layers/2/'):
    quantized.quantize_streamed(TransformerConfig.tiny(num_layers=3, **GEMMA_LIKE), lazy,
                                QuantPolicy((QuantRule('.*', int_format(8)),)))
