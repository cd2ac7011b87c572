"""The one draft-verify round over either cache: `kvcache.forward` and `paged.forward` are the
same forward (lengths advanced by num_new_B per row), so a round over contiguous caches and a
round over paged ones emit the same tokens and leave the draft holding the target's
positions."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax.infer import SamplingParams, as_batch, layer_skip_draft, paged, spec_round
from qjax.nn import Transformer, TransformerConfig, kvcache
from qjax.nn.decode_core import LoopState
from qjax.nn.model_split import merge, split_for_decode

CFG = TransformerConfig.tiny(max_len=32)
B, PAGE, MAX_PAGES = 2, 4, 8
PROMPT_BT = np.array([[5, 9, 2, 7, 1], [3, 3, 8, 0, 4]], np.int32)
LENGTH_B = np.array([4, 2], np.int32)  # ragged: row 1's last two prompt tokens are padding


@pytest.fixture(scope='module')
def models():
  target = Transformer(CFG, rngs=nnx.Rngs(4))
  return target, layer_skip_draft(target, 1)


def _caches(config):
  """An empty contiguous cache and a paged one whose row b owns pages 1 + b * MAX_PAGES..."""
  flat = kvcache.init_cache(config, B, CFG.max_len)
  pool = paged.init_paged_cache(config, num_pages=1 + B * MAX_PAGES, page_size=PAGE,
                                batch=B, max_pages=MAX_PAGES)
  table_BE = 1 + np.arange(B * MAX_PAGES).reshape(B, MAX_PAGES)
  pool = paged.with_step(pool, table_BE, np.zeros((B, 0)), np.zeros(B), np.zeros(B))
  return flat, pool


@functools.partial(jax.jit, static_argnums=(0, 2))
def _forward(graph, state, forward, tokens_BT, cache, num_new_B):
  model = merge(graph, state)
  x_BTD, cache = forward(model, tokens_BT, cache, num_new_B)
  return model.logits(x_BTD), cache


def _prefilled(model):
  """Both caches of `model` after feeding the prompts' first LENGTH_B tokens."""
  graph, state = split_for_decode(model)
  out = []
  for cache, forward in zip(_caches(model.config), (kvcache.forward, paged.forward)):
    logits_BTV, cache = _forward(graph, state, forward, jnp.asarray(PROMPT_BT), cache,
                                 jnp.asarray(LENGTH_B))
    out.append((logits_BTV, cache))
  return out


def test_both_caches_run_the_same_forward(models):
  (flat_BTV, flat), (paged_BTV, pool) = _prefilled(models[0])
  for b, n in enumerate(LENGTH_B):  # the fed positions; the rest are written but hidden
    np.testing.assert_allclose(flat_BTV[b, :n], paged_BTV[b, :n], atol=1e-5)
  np.testing.assert_array_equal(flat.length, LENGTH_B)
  np.testing.assert_array_equal(pool.length, LENGTH_B)


@pytest.mark.parametrize('temperature', [0.0, 0.9])
def test_one_round_program_over_either_cache(models, temperature):
  target, draft = models
  gamma, rounds = 2, 3
  params = as_batch([SamplingParams(temperature=temperature, seed=s) for s in range(B)], B)
  cur_B = PROMPT_BT[np.arange(B), LENGTH_B]
  tg, ts = split_for_decode(target)
  dg, ds = split_for_decode(draft)
  got = []
  for i, forward in enumerate((kvcache.forward, paged.forward)):
    tcache, dcache = _prefilled(target)[i][1], _prefilled(draft)[i][1]
    how = spec_round.RoundConfig(gamma=gamma, block=rounds, forward=forward)
    loop = LoopState.start(cur_B, 12)
    out, tcache, dcache, sums = spec_round.rounds(tg, ts, dg, ds, how, tcache, dcache, loop,
                                                  params)
    # Every row ran every round: its cache holds the prompt and what it emitted but the last.
    np.testing.assert_array_equal(tcache.length, LENGTH_B + out.num_B)
    np.testing.assert_array_equal(dcache.length, tcache.length)
    assert int(out.steps) == rounds and np.all(sums['rounds_B'] == rounds)
    got.append((np.asarray(out.tok_BW), np.asarray(out.num_B), sums))
  (tok_flat, num_flat, sums_flat), (tok_paged, num_paged, sums_paged) = got
  np.testing.assert_array_equal(num_flat, num_paged)
  np.testing.assert_array_equal(tok_flat, tok_paged)
  np.testing.assert_array_equal(sums_flat['accepted_BA'], sums_paged['accepted_BA'])
