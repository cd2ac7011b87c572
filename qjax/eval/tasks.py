"""Two offline tasks built from the repository's corpora with a fixed seed, scored for a float
and a quantized model with a confidence interval on the difference.

* `last_word`: a passage of the corpus ending before a word of >= `min_chars` letters; correct
  when the model's greedy prediction reproduces every token of the next word (" word").
  Chance is ~0 (one word among thousands).
* `cloze`: the same kind of passage with four candidate next words: the true one and three
  distractors drawn from the corpus' words of similar frequency (0.5x-2x its count) and the
  same first-letter case; correct when the true word has the highest summed log-probability.
  Chance is 25%.

Items are a pure function of (corpus text, tokenizer, seed, sizes), so every model of a
comparison sees the same items. Scoring runs one jitted function of fixed shape per model.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_WORD = re.compile(r"[A-Za-z]+")


@dataclasses.dataclass(frozen=True)
class Task:
  """Scored rows of one task.

  Attributes:
    name: 'last_word' or 'cloze'.
    tokens: int [R, T] rows (context + candidate, right-padded with 0).
    mask: bool [R, T]: positions whose token is part of the candidate (scored).
    item: int [R]: the item each row belongs to.
    correct_row: int [n_items]: the row of the true candidate of each item.
    chance: accuracy of random guessing.
    description: how the items were built, in words.
  """

  name: str
  tokens: np.ndarray
  mask: np.ndarray
  item: np.ndarray
  correct_row: np.ndarray
  chance: float
  description: str

  @property
  def n_items(self) -> int:
    return len(self.correct_row)


def _strip_bos(ids, bos):
  ids = [int(i) for i in ids]
  return ids[1:] if bos is not None and ids and ids[0] == bos else ids


def _passages(text: str, n: int, context_chars: int, min_chars: int, seed: int):
  """(context, word) pairs: `context_chars` of text ending just before a word."""
  rng = np.random.default_rng(seed)
  words = [m for m in _WORD.finditer(text) if len(m.group()) >= min_chars
           and m.start() > context_chars and text[m.start() - 1] == ' ']
  if len(words) < n:
    raise ValueError(f'tasks: the corpus has {len(words)} candidate words, fewer than the '
                     f'{n} items asked for; lower n_items or min_chars.')
  pick = rng.choice(len(words), size=n, replace=False)
  out = []
  for i in sorted(pick):
    m = words[i]
    ctx = text[m.start() - context_chars:m.start() - 1]
    ctx = ctx[ctx.find(' ') + 1:] if ' ' in ctx else ctx  # start at a word boundary
    out.append((ctx, m.group()))
  return out


def _rows(encode, bos, ctx: str, cands, context_tokens: int):
  """Token rows context + ' ' + candidate, the context cut to its last `context_tokens`."""
  c_ids = _strip_bos(encode(ctx), bos)
  rows = []
  for cand in cands:
    full = _strip_bos(encode(ctx + ' ' + cand), bos)
    n_common = len(c_ids)
    if full[:n_common] != c_ids:  # the word merged with the context's last token
      n_common = next((k for k in range(len(c_ids)) if full[k] != c_ids[k]), len(c_ids))
    tail = full[n_common:]
    if not tail:
      return None
    head = full[:n_common][-context_tokens:]
    head = ([bos] + head[1:]) if bos is not None else head
    rows.append((head, tail))
  return rows


def build(text: str, encode: Callable[[str], np.ndarray], *, bos: Optional[int],
          n_items: int = 100, context_tokens: int = 48, context_chars: int = 400,
          min_chars: int = 5, seed: int = 0, source: str = '') -> dict:
  """Both tasks' items from one corpus.

  Args:
    text: the corpus.
    encode: the tokenizer's text -> ids (a leading BOS, if it adds one, is removed).
    bos: the BOS id put first in every row (None: no BOS).
    n_items: items per task.
    context_tokens: tokens of context kept before the word (BOS included).
    context_chars: characters of text taken before the word (then cut to tokens).
    min_chars: shortest target word.
    seed: the item sampling seed.
    source: the corpus name, for the description.

  Returns:
    {'last_word': Task, 'cloze': Task}.
  """
  rng = np.random.default_rng(seed + 1)
  counts = collections.Counter(w for w in _WORD.findall(text) if len(w) >= min_chars)
  by_count = sorted(counts, key=lambda w: (counts[w], w))
  keys = [counts[w] for w in by_count]
  lw, cz = [], []
  for ctx, word in _passages(text, n_items * 2, context_chars, min_chars, seed):
    if len(lw) >= n_items:
      break
    lo = np.searchsorted(keys, counts[word] / 2)
    hi = np.searchsorted(keys, counts[word] * 2, side='right')
    pool = [w for w in by_count[lo:hi] if w.lower() != word.lower()
            and w[0].isupper() == word[0].isupper()]
    if len(pool) < 3:
      continue
    distract = list(rng.choice(pool, size=3, replace=False))
    rows = _rows(encode, bos, ctx, [word] + distract, context_tokens)
    if rows is None:
      continue
    lw.append(rows[0])
    cz.append(rows)
  if len(lw) < n_items:
    raise ValueError(f'tasks: only {len(lw)} usable items from {source or "the corpus"}; '
                     'lower n_items or min_chars.')
  desc = (f'{source}: {n_items} passages (seed {seed}) of <= {context_tokens} tokens ending '
          f'before a word of >= {min_chars} letters')
  return {
      'last_word': _pack('last_word', [[r] for r in lw], 0.0,
                         desc + '; correct = greedy reproduces every token of the word'),
      'cloze': _pack('cloze', cz, 0.25, desc + '; 4 choices (3 frequency-matched corpus '
                     'words); correct = the true word has the highest summed log-prob')}


def _pack(name, items, chance, desc) -> Task:
  rows = [r for it in items for r in it]
  width = max(len(h) + len(t) for h, t in rows)
  width = -(-width // 16) * 16
  tokens = np.zeros((len(rows), width), np.int32)
  mask = np.zeros((len(rows), width), bool)
  for i, (h, t) in enumerate(rows):
    tokens[i, :len(h) + len(t)] = h + t
    mask[i, len(h):len(h) + len(t)] = True
  item = np.repeat(np.arange(len(items)), [len(it) for it in items])
  first = np.concatenate([[0], np.cumsum([len(it) for it in items])[:-1]])
  return Task(name, tokens, mask, item, first.astype(np.int32), chance, desc)


@functools.partial(jax.jit, static_argnums=0)
def _score(graphdef, state, tokens_BT, mask_BT):
  """Per row: summed log-prob of the masked tokens, and whether greedy gets them all."""
  logits = nnx.merge(graphdef, state)(tokens_BT[:, :-1]).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, -1)
  tgt, m = tokens_BT[:, 1:], mask_BT[:, 1:]
  lp = jnp.take_along_axis(logp, tgt[..., None], -1)[..., 0]
  hit = jnp.argmax(logits, -1) == tgt
  return jnp.sum(jnp.where(m, lp, 0.0), -1), jnp.all(jnp.where(m, hit, True), -1)


def score(model: nnx.Module, task: Task, batch: int = 8) -> np.ndarray:
  """Per-item correctness (0/1) of `model` on `task`."""
  graphdef, state = nnx.split(model)
  r = len(task.tokens)
  pad = -r % batch
  toks = np.concatenate([task.tokens, np.zeros((pad,) + task.tokens.shape[1:], np.int32)])
  mask = np.concatenate([task.mask, np.zeros((pad,) + task.mask.shape[1:], bool)])
  lps, hits = [], []
  for i in range(0, len(toks), batch):
    lp, hit = _score(graphdef, state, jnp.asarray(toks[i:i + batch]),
                     jnp.asarray(mask[i:i + batch]))
    lps.append(np.asarray(lp))
    hits.append(np.asarray(hit))
  lp, hit = np.concatenate(lps)[:r], np.concatenate(hits)[:r]
  if task.name == 'last_word':
    return hit[task.correct_row].astype(np.float64)
  best = np.full(task.n_items, -np.inf)
  arg = np.zeros(task.n_items, np.int64)
  for row in range(r):
    if lp[row] > best[task.item[row]]:
      best[task.item[row]], arg[task.item[row]] = lp[row], row
  return (arg == task.correct_row).astype(np.float64)


def interval(x: np.ndarray, z: float = 1.96) -> tuple[float, float]:
  """Normal-approximation 95% interval of the mean of `x` (per-item scores or differences)."""
  n = len(x)
  m = float(np.mean(x))
  se = float(np.std(x, ddof=1) / math.sqrt(n)) if n > 1 else 0.0
  return m - z * se, m + z * se


def compare(float_model, quant_model, task: Task, batch: int = 8,
            float_scores: Optional[np.ndarray] = None) -> dict:
  """Float and quantized accuracy on `task`, and the paired difference with its 95% CI.

  Returns:
    {'float', 'quant', 'delta', 'float_ci', 'quant_ci', 'delta_ci', 'n', 'chance',
     'description'}.
  """
  f = score(float_model, task, batch) if float_scores is None else float_scores
  q = score(quant_model, task, batch)
  return {'float': float(f.mean()), 'quant': float(q.mean()), 'delta': float((q - f).mean()),
          'float_ci': interval(f), 'quant_ci': interval(q), 'delta_ci': interval(q - f),
          'n': task.n_items, 'chance': task.chance, 'description': task.description}
