"""Cheaper drafts: the truncated-vocabulary head (exact output) and the distilled layer skip."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from qjax import data
from qjax.infer import (SamplingBatch, SamplingParams, layer_skip_draft, processed_logits,
                        speculative_generate)
from qjax.pipeline import draft as qdraft
from qjax.pipeline import speculative_sweep
from qjax.nn import Transformer, TransformerConfig, greedy_generate

_forward = nnx.jit(lambda model, tokens_BT: model(tokens_BT))
V = 8
CFG = TransformerConfig.tiny(vocab_size=V, max_len=32)
HEAD = np.array([0, 2, 3, 5, 6])  # q = 0 on tokens 1, 4, 7


@pytest.fixture(scope='module')
def target():
  return Transformer(CFG, rngs=nnx.Rngs(3))


def test_frequent_tokens_keeps_the_most_frequent_ids_and_the_forced_ones():
  ids = np.array([5, 5, 5, 2, 2, 9, 7])
  np.testing.assert_array_equal(qdraft.frequent_tokens(ids, 2), [2, 5])
  np.testing.assert_array_equal(qdraft.frequent_tokens(ids, 2, always=(0, 5)), [0, 2, 5])
  with pytest.raises(ValueError, match='k=0'):
    qdraft.frequent_tokens(ids, 0)


def test_truncated_head_scores_its_ids_as_the_full_head_and_nothing_else(target):
  draft = qdraft.truncated_head_draft(target, HEAD)
  tokens = jnp.array([[1, 4, 7, 0]])
  full, cut = np.asarray(_forward(target, tokens)), np.asarray(_forward(draft, tokens))
  np.testing.assert_allclose(cut[..., HEAD], full[..., HEAD], rtol=1e-5, atol=1e-5)
  off = np.setdiff1d(np.arange(V), HEAD)
  assert np.all(np.isneginf(cut[..., off]))
  with pytest.raises(ValueError, match='unique ids in'):
    qdraft.truncated_head_draft(target, [0, 8])
  with pytest.raises(ValueError, match='1 duplicates'):
    qdraft.truncated_head_draft(target, [0, 2, 2])


def test_truncated_head_draft_is_exact_greedy_and_sampled(target):
  """One batch (one compile): 2 greedy rows, then 3000 seeded sampled rows of one prompt."""
  draft = qdraft.truncated_head_draft(layer_skip_draft(target, 1), HEAD)
  n, prompt = 3000, jnp.array([[3, 1, 4]])
  params = [SamplingParams(temperature=0.0)] * 2 + [
      SamplingParams(temperature=1.0, seed=s) for s in range(n)]
  out, st = speculative_generate(target, draft, jnp.repeat(prompt, n + 2, 0), 3,
                                 params=params, gamma=2)
  out = np.asarray(out)
  want = np.asarray(greedy_generate(target, prompt, 3))[0]
  np.testing.assert_array_equal(out[:2], np.stack([want, want]))
  # The first token's law is the target's (chi-square p > 1e-3), tokens the draft can never
  # propose are emitted (through the residual), and the emitted law computed from p and q
  # is p to float rounding (the sweep's kl_exact column).
  first = out[2:, 3]
  p_V = np.exp(np.asarray(processed_logits(_forward(target, prompt)[:, -1],
                                           SamplingBatch.stack(params[2:3])))[0], dtype=float)
  counts = np.bincount(first, minlength=V)
  assert stats.chisquare(counts, n * p_V / p_V.sum())[1] > 1e-3
  assert counts[np.setdiff1d(np.arange(V), HEAD)].sum() > 0
  assert 0.05 < st.alpha < 0.95
  assert abs(st.kl_exact) < 1e-5


def test_distillation_raises_agreement_and_leaves_the_target_alone(tmp_path):
  target = Transformer(TransformerConfig.tiny(max_len=64), rngs=nnx.Rngs(0))
  text = data.corpus('tinyshakespeare')
  ids = np.frombuffer(text.encode(), np.uint8).astype(np.int32)
  train, held = ids[200_000:int(0.9 * ids.size)], ids[int(0.9 * ids.size):]
  windows = np.stack([held[i * 64:(i + 1) * 64] for i in range(8)])
  probe = jnp.asarray(windows[:2])
  target_before = np.asarray(_forward(target, probe))
  plain = layer_skip_draft(target, 1)
  before = {t: qdraft.agreement(target, plain, windows, t) for t in (0.0, 1.0)}
  draft, hist = qdraft.distill_layer_skip(target, 1, train, steps=50, batch=8, seq_len=32,
                                          learning_rate=3e-3, log=lambda s: None)
  after = {t: qdraft.agreement(target, draft, windows, t) for t in (0.0, 1.0)}
  # Measured (seed 0): greedy 0.17 -> 0.39, T=1 0.66 -> 0.77; margins well inside those.
  assert after[0.0] > before[0.0] + 0.1, (before, after)
  assert after[1.0] > before[1.0] + 0.05, (before, after)
  assert np.mean([h['kl'] for h in hist[-5:]]) < np.mean([h['kl'] for h in hist[:5]])
  np.testing.assert_array_equal(np.asarray(_forward(target, probe)), target_before)
  path = str(tmp_path / 'skip1.npz')
  qdraft.save_distilled(draft, path)
  np.testing.assert_array_equal(np.asarray(_forward(qdraft.load_distilled(target, path),
                                                    probe)),
                                np.asarray(_forward(draft, probe)))
  other = Transformer(TransformerConfig.tiny(max_len=64, d_model=32), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='another model'):
    qdraft.load_distilled(other, path)
  with pytest.raises(ValueError, match='skip1_distilled.npz'):
    speculative_sweep.make_draft(target, 'skip1d', distilled_dir=str(tmp_path / 'none'))
  with pytest.raises(ValueError, match='head_tokens'):
    speculative_sweep.make_draft(target, 'skip1+head64')
