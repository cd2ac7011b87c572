"""qjax.eval.tasks (items, scoring, intervals) and honest activation formats."""

import numpy as np
import pytest
from flax import nnx

from qjax.core import QFormat, fp8_format, int_format
from qjax.data import corpus
from qjax.eval import tasks as qtasks
from qjax.nn import QuantRule, Transformer, TransformerConfig
from qjax.train.data import ByteTokenizer

TEXT = corpus('tinyshakespeare')[:40_000]


def test_items_are_a_function_of_the_seed_and_well_formed():
  tok = ByteTokenizer()
  a = qtasks.build(TEXT, tok.encode, bos=tok.bos_id, n_items=5, context_tokens=30, seed=3)
  b = qtasks.build(TEXT, tok.encode, bos=tok.bos_id, n_items=5, context_tokens=30, seed=3)
  c = qtasks.build(TEXT, tok.encode, bos=tok.bos_id, n_items=5, context_tokens=30, seed=4)
  np.testing.assert_array_equal(a['cloze'].tokens, b['cloze'].tokens)
  assert not np.array_equal(a['cloze'].tokens, c['cloze'].tokens)
  cz, lw = a['cloze'], a['last_word']
  assert cz.tokens.shape[0] == 4 * 5 and lw.tokens.shape[0] == 5
  assert (cz.tokens[:, 0] == tok.bos_id).all()
  for row in range(len(cz.tokens)):  # the scored positions spell ' <word>' of >= 5 letters
    word = tok.decode(cz.tokens[row][cz.mask[row]])
    assert word.startswith(' ') and len(word.strip()) >= 5 and word.strip().isalpha()
  # The true candidate of each cloze item is the last-word target.
  for i in range(5):
    r = cz.correct_row[i]
    np.testing.assert_array_equal(cz.tokens[r][cz.mask[r]], lw.tokens[i][lw.mask[i]])


class _Oracle(nnx.Module):
  """A 'model' whose logits put all mass on the true next byte of the task rows."""

  def __init__(self, rows):
    self.rows = nnx.Variable(np.asarray(rows))

  def __call__(self, tokens_BT):
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    nxt = jnp.concatenate([tokens_BT[:, 1:], tokens_BT[:, -1:]], 1)
    return jax_one_hot(nxt, 256) * 100.0  # exp(-100) underflows: log-probs exactly 0


def jax_one_hot(x, n):
  import jax  # pylint: disable=g-import-not-at-top
  return jax.nn.one_hot(x, n)


def test_scoring_golden_with_a_model_that_sees_the_answer():
  tok = ByteTokenizer()
  t = qtasks.build(TEXT, tok.encode, bos=None, n_items=4, context_tokens=20)
  # Greedy on the last-word rows equals the targets: all correct. On cloze rows every
  # candidate is 'seen', each scores ~0 log-prob: the first maximum wins, the true word
  # (row 0 of each item) -> all correct too.
  assert qtasks.score(_Oracle(t['last_word'].tokens), t['last_word'], batch=3).tolist() == [1.0] * 4
  assert qtasks.score(_Oracle(t['cloze'].tokens), t['cloze'], batch=5).tolist() == [1.0] * 4
  model = Transformer(TransformerConfig.tiny(), rngs=nnx.Rngs(0))
  assert qtasks.score(model, t['last_word']).tolist() == [0.0] * 4  # chance ~0


def test_interval_golden():
  lo, hi = qtasks.interval(np.asarray([0.0, 1.0, 1.0, 0.0]))
  se = np.std([0, 1, 1, 0], ddof=1) / 2
  np.testing.assert_allclose([lo, hi], [0.5 - 1.96 * se, 0.5 + 1.96 * se])


@pytest.mark.parametrize('act', [int_format(4), QFormat(bits=4, kind='int'),
                                 int_format(8, symmetric=False)])
def test_unsupported_activation_formats_are_refused(act):
  with pytest.raises(ValueError, match='not implemented'):
    QuantRule('.*', int_format(4, group_size=32), act=act)  # e.g. W4A4


def test_supported_activation_formats_are_accepted():
  QuantRule('.*', int_format(4, group_size=32), act=int_format(8))   # W4A8
  QuantRule('.*', fp8_format('e4m3'), act=fp8_format('e4m3'))        # fp8 x fp8
