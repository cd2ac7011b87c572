"""Cheaper drafts for speculative decoding: a truncated-vocabulary head and a distilled layer skip.

    from qjax.pipeline import draft as qdraft
    ids = qdraft.frequent_tokens(train_ids, 8192, always=(bos, eos))
    d = qdraft.truncated_head_draft(qdraft_base, ids)      # logits over 8192 tokens only
    d, log = qdraft.distill_layer_skip(target, 6, train_ids, steps=200)
    qdraft.agreement(target, d, windows_BT, temperature=1.0)   # 1 - E[TV], teacher forced

Truncated head: Gemma 3 270M's tied 262k x 640 head is most of a decode step's FLOPs, and a
draft that keeps it costs most of a target step. `truncated_head_draft` computes the draft's
logits only over K frequent token ids and gives every other token probability 0 (logit
-inf). The rejection sampling of `speculative_core.verify` keeps the output exact for any q,
this one included: a target token outside the subset can still be emitted, as the residual
max(0, p - q) keeps its whole mass p.

Distilled layer skip: `layer_skip_draft` shares the target's arrays; `distill_layer_skip`
copies the first k blocks and the final norm and fine-tunes them with the logit KL of
`qjax.train.distill.distill_loss` (temperature T, no label term) so that the shallow draft
agrees with the full target. The embedding / head stays the target's own, frozen and
shared (for Gemma it is 671 MB in float32; training it would need 3x that for Adam).
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from qjax.infer.speculative import layer_skip_draft
from qjax.nn.attention import softcap
from qjax.nn.transformer import Transformer
from qjax.train.distill import distill_loss


def frequent_tokens(token_ids, k: int, always: Sequence[int] = ()) -> np.ndarray:
  """The `k` most frequent ids of `token_ids` (ties by id), plus `always`, sorted (int32).

  Args:
    token_ids: training text as token ids (any shape).
    k: how many frequent ids to keep (>= 1); ids that never occur fill the rest by id order.
    always: ids kept whatever their count (e.g. BOS / EOS).

  Returns:
    Sorted unique ids, at most k + len(always).
  """
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
    raise ValueError(f'frequent_tokens: k={k!r} must be an int >= 1 (head size, e.g. 8192).')
  ids = np.asarray(token_ids).ravel().astype(np.int64)
  counts = np.bincount(ids, minlength=k) if ids.size else np.zeros(k, np.int64)
  top = np.argsort(-counts, kind='stable')[:k]
  return np.unique(np.concatenate([top, np.asarray(always, np.int64)])).astype(np.int32)


class TruncatedHeadTransformer(Transformer):
  """A `Transformer` whose logits cover only `head_ids`; every other token gets -inf.

  Built by `truncated_head_draft` (its blocks are another model's); `head_rows` holds the
  head's rows of those ids (K x D, float32), `head_ids` the ids (K,).
  """

  def logits(self, x_BTD: jax.Array) -> jax.Array:
    h_BTD = self.final_norm(x_BTD)
    rows_VD = self.head_rows[...]  # the kept ids' rows: this V is the truncated vocabulary
    logits_BTV = jnp.einsum('BTD,VD->BTV', h_BTD.astype(rows_VD.dtype), rows_VD,
                            preferred_element_type=jnp.float32)
    logits_BTV = softcap(logits_BTV, self.config.final_logit_softcap)
    b, t, _ = logits_BTV.shape
    full_BTV = jnp.full((b, t, self.config.vocab_size), -jnp.inf, jnp.float32)
    return full_BTV.at[..., self.head_ids[...]].set(logits_BTV)


def _head_rows(model: Transformer, ids: np.ndarray) -> jax.Array:
  """The head's weight rows of `ids` as a float32 (K, D) array (dequantized if quantized)."""
  from qjax.core import QArray, dequantize  # pylint: disable=g-import-not-at-top
  if model.lm_head is None:  # tied: the embedding table is V x D
    w = model.embed.w.get_value()
    rows = dequantize(w, jnp.float32)[ids] if isinstance(w, QArray) else w[ids]
  else:  # untied: D x V
    w = model.lm_head.w.get_value()
    rows = (dequantize(w, jnp.float32) if isinstance(w, QArray) else w)[:, ids].T
  return jnp.asarray(rows, jnp.float32)


def truncated_head_draft(model: Transformer, head_ids) -> TruncatedHeadTransformer:
  """`model` (any draft: the target, quantized, layer-skipped) with its head cut to `head_ids`.

  Args:
    model: the draft whose embedding, blocks and final norm are kept (shared, not copied).
    head_ids: the token ids the head scores (`frequent_tokens`), unique, in [0, V).

  Returns:
    A `TruncatedHeadTransformer`: the same config, logits -inf outside `head_ids`. The head
    rows are a float32 copy (K x D: 21 MB at K = 8192, D = 640).
  """
  cfg = model.config
  ids = np.asarray(head_ids)
  if ids.ndim != 1 or ids.size < 1 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f'truncated_head_draft: head_ids must be a non-empty 1-D array of int '
                     f'token ids, got shape {ids.shape} dtype {ids.dtype}.')
  if ids.min() < 0 or ids.max() >= cfg.vocab_size or np.unique(ids).size != ids.size:
    raise ValueError(f'truncated_head_draft: head_ids must be unique ids in [0, '
                     f'{cfg.vocab_size}); got min {ids.min()}, max {ids.max()}, '
                     f'{ids.size - np.unique(ids).size} duplicates. Use frequent_tokens().')
  ids = np.sort(ids).astype(np.int32)
  out = nnx.eval_shape(lambda: TruncatedHeadTransformer(cfg, rngs=nnx.Rngs(0)))
  out.embed, out.final_norm, out.lm_head = model.embed, model.final_norm, model.lm_head
  out.layers = model.layers
  out.head_ids = nnx.Variable(jnp.asarray(ids))
  out.head_rows = nnx.Variable(_head_rows(model, ids))
  return out


_forward = nnx.jit(lambda model, tokens_BT: model(tokens_BT))


def agreement(target: Transformer, draft: Transformer, windows_BT, temperature: float = 1.0,
              batch: int = 4) -> float:
  """Teacher-forced acceptance estimate: the mean over positions of 1 - TV(p_T, q_T).

  At temperature 0 it is the fraction of positions where the argmaxes agree (greedy alpha);
  at T > 0 it is the mean of sum_v min(p, q) of the temperature-T softmaxes, the alpha that
  speculative sampling would measure on this text.

  Args:
    target, draft: models of one vocabulary.
    windows_BT: int token windows (text that is not the draft's training text).
    temperature: >= 0.
    batch: rows per forward.

  Returns:
    The mean agreement in [0, 1].
  """
  windows_BT = np.asarray(windows_BT, np.int32)
  total, count = 0.0, 0
  for i in range(0, len(windows_BT), batch):
    w = jnp.asarray(windows_BT[i:i + batch])
    p, q = _forward(target, w), _forward(draft, w)
    if temperature == 0:
      agree = jnp.argmax(p, -1) == jnp.argmax(q, -1)
    else:
      agree = jnp.sum(jnp.minimum(jax.nn.softmax(p / temperature, -1),
                                  jax.nn.softmax(q / temperature, -1)), -1)
    total += float(jnp.sum(agree))
    count += int(agree.size)
  return total / max(count, 1)


# The distilled draft trains its blocks and final norm; the head / embedding stays shared.
_TRAINED = nnx.All(nnx.Param, nnx.Not(nnx.PathContains('embed')),
                   nnx.Not(nnx.PathContains('lm_head')))


@nnx.jit(static_argnames=('temperature',))
def _distill_step(student, optimizer, teacher, batch_BT1, *, temperature):
  """One Adam step of the student's blocks on KL(teacher_T || student_T)."""
  tokens_BT, labels_BT = batch_BT1[:, :-1], batch_BT1[:, 1:]
  teacher_BTV = jax.lax.stop_gradient(teacher(tokens_BT))

  def loss_fn(model):
    return distill_loss(model(tokens_BT), teacher_BTV, labels_BT, alpha=0.0,
                        temperature=temperature)

  (loss, aux), grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, _TRAINED),
                                          has_aux=True)(student)
  optimizer.update(student, grads)
  return loss, aux


def distill_layer_skip(target: Transformer, num_layers: int, train_ids, *, steps: int,
                       batch: int = 2, seq_len: int = 64, learning_rate: float = 1e-4,
                       temperature: float = 1.0, seed: int = 0,
                       max_seconds: Optional[float] = None,
                       log: Callable[[str], None] = print):
  """The target's first `num_layers` blocks + its head, distilled to agree with the target.

  Args:
    target: the float target (only read).
    num_layers: k, the draft's depth (`layer_skip_draft`).
    train_ids: 1-D token ids of training text (never the text the draft is scored on).
    steps: optimizer steps (>= 1).
    batch, seq_len: random windows of seq_len + 1 tokens per step.
    learning_rate: AdamW learning rate.
    temperature: the softmax temperature of the KL (distill_loss, no label term).
    seed: window sampling seed.
    max_seconds: stop early once this much wall time is spent (None: run all steps).
    log: progress printer (every ~10% of the steps).

  Returns:
    (draft, history): a `Transformer` with copies of the first k blocks and the final norm
    (trained) and the target's embedding / head (shared, frozen); history is a list of
    dicts (step, kl, seconds).
  """
  if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
    raise ValueError(f'distill_layer_skip: steps={steps!r} must be an int >= 1.')
  ids = np.asarray(train_ids).ravel().astype(np.int32)
  if ids.size < seq_len + 2:
    raise ValueError(f'distill_layer_skip: {ids.size} training tokens are fewer than '
                     f'seq_len + 2 = {seq_len + 2}; pass more text or a shorter seq_len.')
  draft = layer_skip_draft(target, num_layers)
  draft.layers = nnx.List([nnx.clone(layer) for layer in draft.layers])
  draft.final_norm = nnx.clone(draft.final_norm)
  optimizer = nnx.Optimizer(draft, optax.adamw(learning_rate, weight_decay=0.0),
                            wrt=_TRAINED)
  rng = np.random.default_rng(seed)
  history, t0 = [], time.perf_counter()
  for step in range(steps):
    starts = rng.integers(0, ids.size - seq_len - 1, batch)
    batch_BT1 = jnp.asarray(np.stack([ids[s:s + seq_len + 1] for s in starts]))
    _, aux = _distill_step(draft, optimizer, target, batch_BT1, temperature=temperature)
    seconds = time.perf_counter() - t0
    history.append(dict(step=step + 1, kl=float(aux['kl']), seconds=seconds))
    if (step + 1) % max(steps // 10, 1) == 0 or step == 0:
      log(f'distill skip{num_layers}: step {step + 1}/{steps} kl {history[-1]["kl"]:.4f} '
          f'({seconds:.0f} s)')
    if max_seconds is not None and seconds > max_seconds:
      log(f'distill skip{num_layers}: stopped after {step + 1} steps ({seconds:.0f} s).')
      break
  return draft, history


def _trained_leaves(draft: Transformer) -> dict:
  flat = nnx.to_flat_state(nnx.state(draft, _TRAINED))
  return {'/'.join(str(k) for k in path): np.asarray(v.get_value()) for path, v in flat}


def save_distilled(draft: Transformer, path: str) -> None:
  """Write the trained arrays of a `distill_layer_skip` draft (blocks, final norm) as .npz."""
  np.savez(path, num_layers=draft.config.num_layers, **_trained_leaves(draft))


def load_distilled(target: Transformer, path: str) -> Transformer:
  """A `distill_layer_skip` draft of `target` with the arrays `save_distilled` wrote.

  Raises:
    ValueError: the file's arrays do not match the target's first k blocks (another model).
  """
  with np.load(path) as f:
    saved = {k: f[k] for k in f.files}
  k = int(saved.pop('num_layers'))
  draft = layer_skip_draft(target, k)
  draft.layers = nnx.List([nnx.clone(layer) for layer in draft.layers])
  draft.final_norm = nnx.clone(draft.final_norm)
  want = _trained_leaves(draft)
  if set(want) != set(saved) or any(want[n].shape != saved[n].shape for n in want):
    raise ValueError(f'load_distilled: {path} holds arrays for another model (its keys or '
                     f'shapes differ from the first {k} blocks of this target); distil again.')
  state = nnx.state(draft, _TRAINED)
  for path_key, var in nnx.to_flat_state(state):
    var.set_value(jnp.asarray(saved['/'.join(str(p) for p in path_key)]))
  nnx.update(draft, state)
  return draft
