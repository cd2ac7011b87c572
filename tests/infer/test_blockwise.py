"""Blockwise (online-softmax) attention == dense attention; its compiled memory is O(T)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax.infer import attention_temp_bytes, with_attention_impl
from qjax.infer.blockwise import bucket_perplexity, forward_temp_bytes, token_nll
from qjax.nn import Transformer, TransformerConfig, attend, init_cache
from qjax.nn.attention import attend_blockwise


def _qkv(b, t, s, n, k, h, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (b, t, n, h)), jax.random.normal(kk, (b, s, k, h)),
          jax.random.normal(kv, (b, s, k, h)))


@pytest.mark.parametrize('n, k, window, cap, block', [
    (4, 4, None, None, 8), (4, 2, 5, 20.0, 13), (4, 1, None, 1.5, 1)],
    ids=['mha', 'gqa_window_softcap', 'mqa_softcap_block1'])
def test_equals_dense_over_heads_windows_softcaps_and_block_sizes(n, k, window, cap, block):
  b, t, h = 2, 29, 8
  q, kk, v = _qkv(b, t, t, n, k, h)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  want = attend(q, kk, v, pos, pos, window=window, logit_softcap=cap)
  got = jax.jit(lambda *a: attend_blockwise(*a, window=window, logit_softcap=cap,
                                            block_size=block))(q, kk, v, pos, pos)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_ragged_rows_against_a_cache_layout():
  """Rows at different offsets (a ragged prefill chunk) over cache slots 0..S-1 (B = 1)."""
  b, t, s = 3, 7, 24
  q, kk, v = _qkv(b, t, s, 4, 2, 16, seed=1)
  q_pos = jnp.array([0, 5, 17])[:, None] + jnp.arange(t)[None]
  k_pos = jnp.arange(s)[None]
  both = jax.jit(lambda *a: (attend(*a, window=4), attend_blockwise(*a, window=4, block_size=5)))
  want, got = both(q, kk, v, q_pos, k_pos)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_compiled_temp_memory_grows_linearly_not_quadratically():
  dense = [attention_temp_bytes(t, 'dense', head_dim=64) for t in (512, 1024, 2048)]
  block = [attention_temp_bytes(t, 'blockwise', head_dim=64, block_size=128)
           for t in (512, 1024, 2048)]
  for a, b in zip(dense, dense[1:]):
    assert b / a > 3.5, dense  # T x S logits
  for a, b in zip(block, block[1:]):
    assert 1.5 < b / a < 2.5, block
  assert block[-1] * 8 < dense[-1]


def test_model_forward_and_prefill_match_the_dense_model():
  cfg = TransformerConfig.tiny(sliding_window=6, global_every=2, attn_logit_softcap=30.0)
  dense = Transformer(cfg, rngs=nnx.Rngs(0))
  blockwise = with_attention_impl(dense, 'blockwise', block_size=8)
  assert blockwise.config.attention_impl == 'blockwise' and dense.config.attention_impl == 'auto'
  tokens = jax.random.randint(jax.random.key(0), (2, 37), 0, cfg.vocab_size)

  @nnx.jit
  def forwards(dense, blockwise, tokens):
    full = dense(tokens), blockwise(tokens)
    prefill = (dense(tokens, cache=init_cache(cfg, 2, 40))[0],
               blockwise(tokens, cache=init_cache(cfg, 2, 40))[0])
    return full, prefill
  for want, got in forwards(dense, blockwise, tokens):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  # the config field alone selects it too
  built = Transformer(cfg.replace(attention_impl='blockwise', attention_block=16),
                      rngs=nnx.Rngs(0))
  assert all(layer.attn.impl == 'blockwise' for layer in built.layers)


def test_bad_impl_names_raise():
  with pytest.raises(ValueError, match="attention_impl='flash' is unknown"):
    TransformerConfig.tiny(attention_impl='flash')
  with pytest.raises(ValueError, match='attention_block=0 must be a positive integer'):
    TransformerConfig.tiny(attention_block=0)
  with pytest.raises(ValueError, match="impl='flash' is unknown"):
    attention_temp_bytes(64, 'flash')


def test_long_context_nll_equals_the_dense_logits_and_its_memory_is_linear_in_t():
  """`token_nll` (blockwise attention, LM head a chunk at a time) == log-softmax of the full
  dense logits; the tiny model's whole compiled forward has temp memory linear in T
  blockwise (2x per doubling), far below the dense forward's."""
  cfg = TransformerConfig.tiny(sliding_window=6, global_every=2, max_len=1024)
  dense = Transformer(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 37), 0, cfg.vocab_size)
  logits = dense(tokens)[:, :-1]
  want = (jax.nn.logsumexp(logits, -1) -
          jnp.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0])
  blockwise = with_attention_impl(dense, 'blockwise', block_size=8)
  got = token_nll(blockwise, tokens, logits_chunk=5)  # 36 predictions: 8 chunks, padded
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  buckets = bucket_perplexity(got[0], (0, 16))
  assert [(b['start'], b['end'], b['tokens']) for b in buckets] == [(0, 16, 16), (16, 36, 20)]
  np.testing.assert_allclose(buckets[1]['ppl'], np.exp(np.mean(np.asarray(want[0, 16:]))),
                             rtol=1e-5)
  block = [forward_temp_bytes(blockwise, t, logits_chunk=32) for t in (128, 256, 512)]
  for a, b in zip(block, block[1:]):
    assert 1.8 < b / a < 2.2, block
  assert forward_temp_bytes(dense, 512, logits_chunk=32) > 4 * block[-1]  # T x S logits
  with pytest.raises(ValueError, match='give \\(B, T\\) with T >= 2'):
    token_nll(dense, [[1]])
