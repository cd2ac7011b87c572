"""Knowledge distillation (Hinton et al. 2015) from a frozen float teacher.

    loss = alpha * CE(labels, student) + (1 - alpha) * T^2 * KL(softmax(teacher / T) ||
                                                                softmax(student / T))

The T^2 keeps the soft term's gradient on the scale of the hard one as T grows. The teacher
is an argument of the step, not a part of the optimizer: its forward runs under
`stop_gradient`, and the optimizer is built over the student only, so the teacher gets no
update and no optimizer state. The student is the same architecture under QAT
(`qjax.train.qat.prepare_qat` of the teacher) or a smaller model (`student_config`: fewer
layers or a narrower width, as a speculative-decoding draft model is made).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from qjax.nn import TransformerConfig
from qjax.train.qat import TRAINABLE


def check_distill(alpha: float, temperature: float) -> None:
  """ValueError unless 0 <= alpha <= 1 and temperature > 0 (both finite)."""
  if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
    raise ValueError(f'distillation: alpha={alpha!r} must lie in [0, 1] (the weight of the '
                     'label cross entropy; 1 - alpha weighs the teacher term), e.g. 0.5.')
  if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
          and temperature > 0):
    raise ValueError(f'distillation: temperature={temperature!r} must be a finite number > 0 '
                     '(1 = the plain softmax; 2-4 softens it), e.g. 2.0.')


def distill_loss(student_logits_BTV: jax.Array, teacher_logits_BTV: jax.Array,
                 labels_BT: jax.Array, *, alpha: float, temperature: float):
  """Hinton's distillation loss, averaged over positions.

  Args:
    student_logits_BTV: the student's logits.
    teacher_logits_BTV: the teacher's logits (no gradient flows into them).
    labels_BT: next-token ids.
    alpha: weight of the hard-label cross entropy, in [0, 1].
    temperature: softmax temperature T > 0 of the soft term.

  Returns:
    (loss, {'ce': label cross entropy, 'kl': KL(teacher_T || student_T)}).
  """
  check_distill(alpha, temperature)
  if student_logits_BTV.shape != teacher_logits_BTV.shape:
    raise ValueError(f'distill_loss: student logits {student_logits_BTV.shape} and teacher '
                     f'logits {teacher_logits_BTV.shape} differ; the two models must share '
                     'the tokenizer (vocabulary) and see the same tokens.')
  s = student_logits_BTV.astype(jnp.float32)
  t = jax.lax.stop_gradient(teacher_logits_BTV.astype(jnp.float32))
  ce = optax.softmax_cross_entropy_with_integer_labels(s, labels_BT).mean()
  logp_t = jax.nn.log_softmax(t / temperature, axis=-1)
  logp_s = jax.nn.log_softmax(s / temperature, axis=-1)
  kl = jnp.sum(jnp.exp(logp_t) * (logp_t - logp_s), axis=-1).mean()
  loss = alpha * ce + (1.0 - alpha) * temperature ** 2 * kl
  return loss, {'ce': ce, 'kl': kl}


def chunked_distill_loss(student_logits: Callable[[jax.Array], jax.Array], x_BTD: jax.Array,
                         labels_BT: jax.Array, *, chunk: int,
                         teacher_logits: Optional[Callable[[jax.Array], jax.Array]] = None,
                         h_BTD: Optional[jax.Array] = None, alpha: float = 1.0,
                         temperature: float = 1.0):
  """`distill_loss` (or, without a teacher, the label cross entropy) from hidden states, over
  chunks of `chunk` positions whose logits are recomputed in the backward.

  A large vocabulary makes the logits the biggest activations (Gemma's 262k x 128 positions:
  134 MB per f32 [T, V] buffer, several of them live in the loss and its gradient); here at
  most one chunk's [B, chunk, V] buffers exist at a time (`jax.checkpoint` per chunk).

  Args:
    student_logits: [B, t, D] -> [B, t, V] (e.g. `model.logits`: final norm, head, softcap).
    x_BTD: the student's last hidden states (differentiable).
    labels_BT: next-token ids.
    chunk: positions per chunk; must divide T.
    teacher_logits, h_BTD: the teacher's head and its hidden states (no gradient flows into
      them), or None for the cross entropy alone.
    alpha, temperature: as in `distill_loss` (alpha must be 1 without a teacher).

  Returns:
    (loss, {'ce', 'kl'}) averaged over the B * T positions, as `distill_loss` returns them.
  """
  check_distill(alpha, temperature)
  b, t = labels_BT.shape
  if not isinstance(chunk, int) or chunk < 1 or t % chunk:
    raise ValueError(f'chunked_distill_loss: chunk={chunk!r} must be an int >= 1 dividing the '
                     f'{t} positions (e.g. {math.gcd(t, 32)}).')
  if (teacher_logits is None) != (h_BTD is None):
    raise ValueError('chunked_distill_loss: give both teacher_logits and h_BTD, or neither.')
  if teacher_logits is None and alpha != 1.0:
    raise ValueError(f'chunked_distill_loss: alpha={alpha!r} weighs a teacher term, but no '
                     'teacher was given; pass teacher_logits and h_BTD, or alpha=1.')

  @jax.checkpoint
  def part(x, h, y):
    s = student_logits(x).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(s, y).sum()
    if h is None:
      return ce, jnp.zeros((), jnp.float32)
    tl = jax.lax.stop_gradient(teacher_logits(h).astype(jnp.float32))
    logp_t = jax.nn.log_softmax(tl / temperature, axis=-1)
    logp_s = jax.nn.log_softmax(s / temperature, axis=-1)
    return ce, jnp.sum(jnp.exp(logp_t) * (logp_t - logp_s))

  ce = kl = jnp.zeros((), jnp.float32)
  for i in range(0, t, chunk):
    c, k = part(x_BTD[:, i:i + chunk], None if h_BTD is None else h_BTD[:, i:i + chunk],
                labels_BT[:, i:i + chunk])
    ce, kl = ce + c, kl + k
  ce, kl = ce / (b * t), kl / (b * t)
  loss = alpha * ce + (1.0 - alpha) * temperature ** 2 * kl
  return loss, {'ce': ce, 'kl': kl}


def check_teacher(teacher: nnx.Module, student: nnx.Module) -> None:
  """ValueError when the teacher cannot teach the student (another vocabulary)."""
  tv, sv = teacher.config.vocab_size, student.config.vocab_size
  if tv != sv:
    raise ValueError(f'distillation: the teacher has vocab_size={tv} but the student {sv}; '
                     'the KL term compares distributions over one vocabulary. Use a teacher '
                     'checkpoint trained with the student\'s tokenizer.')


def student_config(teacher: TransformerConfig, **changes) -> TransformerConfig:
  """The teacher's config with `changes` (e.g. num_layers=teacher.num_layers // 2, d_ff=...).

  The vocabulary and max_len are the teacher's: a student must read the same tokens.
  """
  for k in ('vocab_size', 'max_len'):
    if k in changes and changes[k] != getattr(teacher, k):
      raise ValueError(f'student_config: {k}={changes[k]} differs from the teacher\'s '
                       f'{getattr(teacher, k)}; a student shares its teacher\'s tokens.')
  return dataclasses.replace(teacher, **changes)


@functools.partial(nnx.jit, static_argnames=('alpha', 'temperature'))
def distill_step(student: nnx.Module, optimizer: nnx.Optimizer, teacher: nnx.Module,
                 batch_BT1: jax.Array, *, alpha: float, temperature: float):
  """One optimizer step of the student on `distill_loss`; the teacher is only read.

  Returns:
    (loss, {'ce', 'kl'}).
  """
  tokens_BT, labels_BT = batch_BT1[:, :-1], batch_BT1[:, 1:]
  teacher_logits_BTV = jax.lax.stop_gradient(teacher(tokens_BT))

  def loss_fn(model):
    return distill_loss(model(tokens_BT), teacher_logits_BTV, labels_BT, alpha=alpha,
                        temperature=temperature)

  (loss, aux), grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, TRAINABLE),
                                          has_aux=True)(student)
  optimizer.update(student, grads)
  return loss, aux
