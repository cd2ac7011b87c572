"""Calibration plumbing: streamed statistics vs a manual forward, w_DF views vs the policy."""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax.algorithms import gptq_quantize
from qjax.algorithms.apply import block_fwd, embed_fwd, head_fwd
from qjax.algorithms.calibrate import (EinsumView, calibration_batches, collect_stats, forward,
                                       token_facts)
from qjax.core import int_format
from qjax.nn import (QuantPolicy, QuantRule, Transformer, TransformerConfig, attend,
                     apply_rope, einsum_layers, quantize_model)


@pytest.fixture(scope='module')
def model():
  return Transformer(TransformerConfig.tiny(), rngs=nnx.Rngs(0))


def _gram(x, rows):
  x = np.asarray(x, np.float64).reshape(-1, rows)
  return 2 * x.T @ x / x.shape[0]


def test_streamed_stats_equal_a_manual_forward(model):
  tokens = jax.random.randint(jax.random.key(0), (6, 16), 0, 256)
  x0 = model.embed.lookup(tokens, jnp.float32)
  blk = model.layers[0]
  # The block's internals, by hand: inputs of q/k/v, o_proj and down_proj.
  h = blk.pre_attn_norm(x0)
  pos = jnp.broadcast_to(jnp.arange(16), (6, 16))
  a = blk.attn
  q = apply_rope(a.q_proj(h), pos, a.rope_base) * a.scale_q
  k = apply_rope(a.k_proj(h), pos, a.rope_base)
  o_in = attend(q, k, a.v_proj(h), pos, pos)  # BTNH; natural rows are (N, H)
  xa = x0 + a.o_proj(o_in)
  hm = blk.pre_mlp_norm(xa)
  d_in = jax.nn.silu(blk.mlp.gate_proj(hm)) * blk.mlp.up_proj(hm)

  # Streamed over 3 uneven batches of sequences.
  batches = [x0[:1], x0[1:4], x0[4:]]
  st = collect_stats(blk, block_fwd, batches, ['attn/q_proj', 'attn/o_proj', 'mlp/down_proj'],
                     kinds=('hessian', 'absmean', 'absmax'))
  for name, x, rows in (('attn/q_proj', h, 64), ('attn/o_proj', o_in, 128),
                        ('mlp/down_proj', d_in, 128)):
    s = st[name]
    assert s.count == 96
    np.testing.assert_allclose(s.hessian, _gram(x, rows), rtol=2e-4, atol=2e-5)
    xr = np.abs(np.asarray(x).reshape(-1, rows))
    np.testing.assert_allclose(s.absmean, xr.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s.absmax, xr.max(0), rtol=1e-5)  # jit vs eager rounding


@pytest.mark.parametrize('fmt,gran', [(int_format(3, group_size=16, symmetric=False), 'channel'),
                                      (int_format(4, group_size=32), 'tensor')],
                         ids=['int3-g16-asym-channel', 'int4-g32-tensor'])
def test_views_reproduce_the_policy_layout(model, fmt, gran):
  """GPTQ with H = I through every layer's w_DF view gives quantize_model's QArray exactly."""
  qm, _ = quantize_model(model, QuantPolicy((QuantRule('.*', fmt, granularity=gran),)))
  ql = dict(einsum_layers(qm))
  for path, layer in einsum_layers(model):
    ref, ref_fmt = ql[path].w.get_value(), ql[path].w.get_metadata()['qformat']
    view = EinsumView.of(layer, ref_fmt)
    w = layer.w.get_value()
    np.testing.assert_array_equal(view.from_2d(view.to_2d(w)), w)
    q = view.to_qarray(gptq_quantize(view.to_2d(w), jnp.eye(view.rows), view.fmt2(ref_fmt)),
                       ref_fmt)
    assert jax.tree.structure(q) == jax.tree.structure(ref) and q.data.dtype == ref.data.dtype
    np.testing.assert_array_equal(q.data, ref.data)
    np.testing.assert_array_equal(q.scale, ref.scale)
    if ref.zero_point is not None:
      np.testing.assert_array_equal(q.zero_point, ref.zero_point)
    # Rows of the view match the natural rows of the layer input through row_perm.
    xin = jax.random.normal(jax.random.key(2), (2, 3) + view.contracted_shape)
    y = jnp.einsum(layer.spec, xin, w).reshape(6, -1)  # columns: outputs in weight order
    y2 = view.x_rows(xin)[:, view.row_perm] @ view.to_2d(w)
    np.testing.assert_allclose(y2, y, rtol=1e-4, atol=1e-4)


def test_calibration_set_checks_and_hash():
  t = np.arange(24, dtype=np.int32).reshape(3, 8)
  assert [b.shape for b in calibration_batches(t, 256, 64, 2)] == [(2, 8), (1, 8)]
  facts = token_facts(t)
  assert facts == {'token_sha256': hashlib.sha256(t.astype('<i4').tobytes()).hexdigest(),
                   'num_sequences': 3, 'seq_len': 8, 'tokens': 24}
  with pytest.raises(ValueError, match='vocab_size=16'):
    calibration_batches(t, 16, 64, 2)
  with pytest.raises(ValueError, match='max_len=4'):
    calibration_batches(t, 256, 4, 2)
  with pytest.raises(ValueError, match=r'\[n, T\] integer'):
    calibration_batches(t.astype(np.float32), 256, 64, 2)


@pytest.mark.parametrize('tied', [True, False])
def test_the_block_walk_reproduces_the_model(tied):
  """apply_method's walk (prologue, blocks, head) is the model's own forward.

  With a final logit softcap: the head step once dropped it (it restated the epilogue).
  """
  cfg = TransformerConfig.tiny(tie_embeddings=tied, embed_scale=True, final_logit_softcap=0.5)
  model = Transformer(cfg, rngs=nnx.Rngs(4))
  tokens = jax.random.randint(jax.random.key(5), (2, 16), 0, 256)
  x = forward(model, embed_fwd, tokens)
  for blk in model.layers:
    x = forward(blk, block_fwd, x)
  y = forward(model, head_fwd, x)
  np.testing.assert_allclose(y, model(tokens), rtol=1e-5, atol=1e-5)
  uncapped = Transformer(cfg.replace(final_logit_softcap=None), rngs=nnx.Rngs(4))
  assert np.abs(uncapped(tokens)).max() > 0.5  # so a dropped softcap would show
