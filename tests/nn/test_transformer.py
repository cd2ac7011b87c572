"""The transformer: cached decode == full forward, ragged rows, phases, causality, windows,
errors, jit, training."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import parameterized
from flax import nnx

from qjax.nn import Transformer, TransformerConfig, greedy_generate, init_cache, kvcache

CONFIGS = {
    'mha': dict(num_kv_heads=4),
    'gqa': dict(),
    'mqa_all_local': dict(num_kv_heads=1, tie_embeddings=False, sliding_window=4),
    'gemma_like': dict(num_kv_heads=1, sliding_window=3, global_every=2,
                       local_rope_base=100.0, qk_norm=True, post_norms=True, mlp='geglu',
                       norm_plus_one=True, embed_scale=True, final_logit_softcap=5.0,
                       attn_logit_softcap=20.0),
}


def _tokens(b, t, seed=0, vocab=256):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab)


class DecodeTest(parameterized.TestCase):

  @parameterized.named_parameters(*[(k, k) for k in CONFIGS])
  def test_incremental_decode_matches_full_forward(self, name):
    cfg = TransformerConfig.tiny(**CONFIGS[name])
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    full = jax.jit(lambda s, tok: nnx.merge(graphdef, s)(tok))
    step = jax.jit(lambda s, tok, c: nnx.merge(graphdef, s)(tok, cache=c))
    tokens = _tokens(2, 10)
    expected = full(state, tokens)
    cache = init_cache(cfg, 2, 12)
    got, cache = step(state, tokens[:, :5], cache)  # prefill
    chunks = [got]
    for i in range(5, 8):  # one token at a time
      logits, cache = step(state, tokens[:, i:i + 1], cache)
      chunks.append(logits)
    logits, cache = step(state, tokens[:, 8:], cache)  # a 2-token chunk
    chunks.append(logits)
    np.testing.assert_array_equal(cache.length, [10, 10])
    np.testing.assert_allclose(jnp.concatenate(chunks, 1), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.backend(
    'cpu',
    reason=(
        'equal to 1e-5 on XLA:CPU, whose GEMMs at 1 and 2 rows differ in the last bits '
        '(1.3e-6 under jax 0.12); GPU GEMMs are chosen per M and may use TF32'))
@pytest.mark.parametrize('fmt', [None, 'int8'])
def test_rows_at_different_lengths_decode_as_if_alone(fmt, full_optimization):
  """A ragged batch: each row keeps its own length, positions and mask."""
  cfg = TransformerConfig.tiny(**CONFIGS['gemma_like'])  # windows and softcaps too
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  step = jax.jit(lambda s, tok, c: nnx.merge(graphdef, s)(tok, cache=c))
  prompts = [_tokens(1, 7, seed=1), _tokens(1, 4, seed=2)]
  next_BT = _tokens(2, 3, seed=3)  # three decode steps

  def decode(cache, rows):
    chunks = []
    for j in range(next_BT.shape[1]):
      logits, cache = step(state, next_BT[rows, j:j + 1], cache)
      chunks.append(logits)
    return np.asarray(jnp.concatenate(chunks, 1)), cache

  prefilled, alone = [], []
  for i, prompt in enumerate(prompts):
    _, cache = step(state, prompt, init_cache(cfg, 1, 12, fmt=fmt))
    prefilled.append(cache)
    alone.append(decode(cache, slice(i, i + 1))[0][0])

  # Written row by row: the rows prefilled alone, stacked into one batch of 2.
  cache = jax.tree.map(lambda *rows: jnp.concatenate(rows), *prefilled)
  np.testing.assert_array_equal(cache.length, [7, 4])
  np.testing.assert_array_equal(kvcache.next_positions(cache, 2), [[7, 8], [4, 5]])
  together, cache = decode(cache, slice(None))
  np.testing.assert_array_equal(cache.length, [10, 7])
  for i in range(2):  # a mask or position error shows at 1e-2 and above
    np.testing.assert_allclose(together[i], alone[i], atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match='row 0 has 10 cached \\+ 3 new tokens exceed the '
                                       'cache max_len=12'):
    nnx.merge(graphdef, state)(next_BT, cache=cache)  # eager: the lengths are known

  # Prefilled together with the short prompt right-padded, then its length set back: the
  # padding's keys sit past the row's positions (masked) until decode overwrites them.
  padded = jnp.concatenate([prompts[0], jnp.pad(prompts[1], ((0, 0), (0, 3)))])
  _, cache = step(state, padded, init_cache(cfg, 2, 12, fmt=fmt))
  cache = dataclasses.replace(cache, length=jnp.asarray([7, 4], jnp.int32))
  together = decode(cache, slice(None))[0]
  for i in range(2):  # a mask or position error shows at 1e-2 and above
    np.testing.assert_allclose(together[i], alone[i], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('name', ['mqa_all_local', 'gemma_like'])
def test_the_phases_compose_to_the_forward(name):
  """embed_tokens -> blocks (or each of model.layers) -> logits is model(tokens)."""
  model = Transformer(TransformerConfig.tiny(**CONFIGS[name]), rngs=nnx.Rngs(2))
  tokens = _tokens(2, 6)
  positions_BT = jnp.broadcast_to(jnp.arange(6), (2, 6))
  want = model(tokens)
  x_BTD = model.embed_tokens(tokens)
  out_BTD, cache = model.run_layers(x_BTD, positions_BT)
  assert cache is None
  np.testing.assert_array_equal(model.logits(out_BTD), want)
  for block in model.layers:
    x_BTD, _ = block(x_BTD, positions_BT)
  np.testing.assert_array_equal(model.logits(x_BTD), want)


@pytest.mark.parametrize('tied', [True, False])
def test_logits_apply_the_final_softcap(tied):
  cfg = TransformerConfig.tiny(tie_embeddings=tied, final_logit_softcap=0.5)
  capped = Transformer(cfg, rngs=nnx.Rngs(3))
  plain = Transformer(cfg.replace(final_logit_softcap=None), rngs=nnx.Rngs(3))
  x_BTD = capped.run_layers(capped.embed_tokens(_tokens(2, 6)),
                        jnp.broadcast_to(jnp.arange(6), (2, 6)))[0]
  raw = np.asarray(plain.logits(x_BTD))
  assert np.abs(raw).max() > 0.5  # the cap changes these logits
  got = np.asarray(capped.logits(x_BTD))
  assert np.abs(got).max() < 0.5
  np.testing.assert_allclose(got, 0.5 * np.tanh(raw / 0.5), rtol=1e-6, atol=1e-7)


@pytest.fixture(scope='module')
def gqa_model():
  return Transformer(TransformerConfig.tiny(), rngs=nnx.Rngs(0))


def test_changing_a_future_token_leaves_past_logits(gqa_model):
  tokens = _tokens(1, 8)
  a = gqa_model(tokens)
  b = gqa_model(tokens.at[0, 5].set((tokens[0, 5] + 1) % 256))
  np.testing.assert_array_equal(a[:, :5], b[:, :5])
  assert not np.allclose(a[:, 5:], b[:, 5:])


def test_token_beyond_the_window_does_not_reach_a_local_layer():
  # One local layer with window 3: position t sees positions t-2..t only.
  cfg = TransformerConfig.tiny(num_layers=1, sliding_window=3)
  model = Transformer(cfg, rngs=nnx.Rngs(1))
  tokens = _tokens(1, 8)
  a = model(tokens)
  b = model(tokens.at[0, 1].set((tokens[0, 1] + 1) % 256))
  assert not np.allclose(a[:, 1:4], b[:, 1:4])  # positions 1..3 see position 1
  np.testing.assert_array_equal(a[:, 4:], b[:, 4:])
  glob = Transformer(cfg.replace(sliding_window=None), rngs=nnx.Rngs(1))
  assert not np.allclose(glob(tokens)[:, 4:], glob(tokens.at[0, 1].set(0))[:, 4:])


def test_too_long_prompts_raise_naming_both_lengths(gqa_model):
  cfg = gqa_model.config
  with pytest.raises(ValueError, match=f'65 tokens is longer than config.max_len={cfg.max_len}'):
    gqa_model(_tokens(1, 65))
  with pytest.raises(ValueError, match='prompt of 9 tokens is longer than the cache max_len=8'):
    gqa_model(_tokens(1, 9), cache=init_cache(cfg, 1, 8))
  _, cache = gqa_model(_tokens(1, 6), cache=init_cache(cfg, 1, 8))
  with pytest.raises(ValueError, match='6 cached \\+ 3 new tokens exceed the cache max_len=8'):
    gqa_model(_tokens(1, 3), cache=cache)
  with pytest.raises(ValueError, match='max_len=100 must be in'):
    init_cache(cfg, 1, 100)
  with pytest.raises(ValueError, match='positions_BT=None'):
    gqa_model(_tokens(1, 3), cache=init_cache(cfg, 1, 8), positions_BT=jnp.zeros((1, 3), int))


def test_jit_forward_and_explicit_positions(gqa_model):
  tokens = _tokens(2, 6)
  jitted = nnx.jit(lambda m, t: m(t))(gqa_model, tokens)
  np.testing.assert_allclose(jitted, gqa_model(tokens), atol=1e-5)
  shifted = gqa_model(tokens, positions_BT=jnp.broadcast_to(jnp.arange(6) + 3, (2, 6)))
  np.testing.assert_allclose(shifted, gqa_model(tokens), atol=1e-4)  # RoPE is relative


def test_greedy_generate_matches_teacher_forced_argmax(gqa_model):
  prompt = _tokens(2, 4, seed=3)
  out = greedy_generate(gqa_model, prompt, 4)
  assert out.shape == (2, 8)
  np.testing.assert_array_equal(out[:, :4], prompt)
  logits = gqa_model(out[:, :-1])
  np.testing.assert_array_equal(jnp.argmax(logits[:, 3:], -1), out[:, 4:])
  with pytest.raises(ValueError, match='exceeds config.max_len=64'):
    greedy_generate(gqa_model, prompt, 61)


def test_one_adamw_step_decreases_loss_on_a_repeated_batch():
  model = Transformer(TransformerConfig.tiny(), rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  tokens = _tokens(4, 16, seed=5)

  def loss_fn(m):
    logits = m(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  @nnx.jit
  def train_step(m, opt):
    loss, grads = nnx.value_and_grad(loss_fn)(m)
    opt.update(m, grads)
    return loss

  losses = [float(train_step(model, optimizer)) for _ in range(3)]
  assert losses[2] < losses[1] < losses[0], losses


def test_bfloat16_compute_runs():
  cfg = TransformerConfig.tiny(dtype='bfloat16')
  logits = Transformer(cfg, rngs=nnx.Rngs(0))(_tokens(1, 4))
  assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())
