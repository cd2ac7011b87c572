"""Distillation: the loss against references, a frozen teacher, smaller students, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from qjax.core import int_format
from qjax.nn import QuantPolicy, QuantRule, Transformer, TransformerConfig
from qjax.train import (QATScale, check_teacher, chunked_distill_loss, distill_loss, distill_step,
                        make_optimizer, make_qat_optimizer, prepare_qat, student_config)

CFG = TransformerConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1,
                        head_dim=32, d_ff=64, max_len=32)


def _logits(key, shape=(2, 5, 64)):
  return jax.random.normal(jax.random.key(key), shape) * 3


def _batch(i, vocab=64):
  return jax.random.randint(jax.random.key(100 + i), (4, 17), 0, vocab)


def test_temperature_one_alpha_one_is_cross_entropy():
  s, t = _logits(0), _logits(1)
  labels = jax.random.randint(jax.random.key(2), (2, 5), 0, 64)
  loss, aux = distill_loss(s, t, labels, alpha=1.0, temperature=1.0)
  ce = optax.softmax_cross_entropy_with_integer_labels(s, labels).mean()
  assert float(loss) == float(ce) and float(aux['ce']) == float(ce)


def test_loss_matches_a_numpy_reference():
  s, t = _logits(3), _logits(4)
  labels = jax.random.randint(jax.random.key(5), (2, 5), 0, 64)
  alpha, temp = 0.3, 2.5
  loss, _ = distill_loss(s, t, labels, alpha=alpha, temperature=temp)

  def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))

  s64, t64 = np.asarray(s, np.float64), np.asarray(t, np.float64)
  ce = -np.take_along_axis(log_softmax(s64), np.asarray(labels)[..., None], -1).mean()
  pt, ps = log_softmax(t64 / temp), log_softmax(s64 / temp)
  kl = (np.exp(pt) * (pt - ps)).sum(-1).mean()
  np.testing.assert_allclose(float(loss), alpha * ce + (1 - alpha) * temp ** 2 * kl, rtol=1e-5)
  # the soft term vanishes when the student is the teacher
  _, aux = distill_loss(t, t, labels, alpha=0.0, temperature=temp)
  assert abs(float(aux['kl'])) < 1e-6


def test_frozen_teacher_is_bit_identical_after_distillation():
  teacher = Transformer(CFG, rngs=nnx.Rngs(0))
  before = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(teacher)))
  pol = QuantPolicy((QuantRule('embed', exempt=True), QuantRule('.*', int_format(3))))
  student, _ = prepare_qat(teacher, pol, learn_scales=True)
  opt = make_qat_optimizer(student, make_optimizer(1e-2, 10, 1), scale_lr=1e-2)
  losses = [float(distill_step(student, opt, teacher, _batch(0), alpha=0.5, temperature=2.0)[0])
            for _ in range(3)]
  after = nnx.to_pure_dict(nnx.state(teacher))
  jax.tree.map(np.testing.assert_array_equal, before, after)
  # Optimizer state for the student only: Adam's two moments per trainable student element
  # (plus step counts), nothing for the teacher.
  size = lambda tree: sum(int(np.size(a)) for a in jax.tree.leaves(tree))
  n_student = size(nnx.state(student, nnx.Any(nnx.Param, QATScale)))
  assert 2 * n_student <= size(nnx.state(opt.opt_state)) < 2 * n_student + 100
  assert losses[-1] < losses[0]
  moved = nnx.to_pure_dict(nnx.state(student, nnx.Param))['layers'][0]['mlp']['up_proj']['w']
  assert not np.array_equal(moved, before['layers'][0]['mlp']['up_proj']['w'])


def test_a_smaller_student_learns_from_the_teacher():
  teacher = Transformer(CFG, rngs=nnx.Rngs(0))
  scfg = student_config(CFG, num_layers=1, d_ff=32)
  student = Transformer(scfg, rngs=nnx.Rngs(1))
  opt = make_qat_optimizer(student, make_optimizer(1e-2, 20, 1))
  first = last = None
  for _ in range(8):
    _, aux = distill_step(student, opt, teacher, _batch(0), alpha=0.0, temperature=1.0)
    first = float(aux['kl']) if first is None else first
    last = float(aux['kl'])
  assert last < first  # the student's distribution moves toward the teacher's


def test_bad_input_is_a_clear_value_error():
  s, t = _logits(0), _logits(1)
  labels = jnp.zeros((2, 5), jnp.int32)
  for temp in (0.0, -1.0, float('nan')):
    with pytest.raises(ValueError, match='temperature'):
      distill_loss(s, t, labels, alpha=0.5, temperature=temp)
  for alpha in (-0.1, 1.5):
    with pytest.raises(ValueError, match='alpha'):
      distill_loss(s, t, labels, alpha=alpha, temperature=1.0)
  teacher = Transformer(CFG, rngs=nnx.Rngs(0))
  student = Transformer(student_config(CFG, num_layers=1), rngs=nnx.Rngs(0))
  opt = make_qat_optimizer(student, optax.sgd(1e-2))
  with pytest.raises(ValueError, match='temperature'):
    distill_step(student, opt, teacher, _batch(0), alpha=0.5, temperature=0.0)
  other = Transformer(TransformerConfig(**{**CFG.__dict__, 'vocab_size': 80}), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='vocab_size=80'):
    check_teacher(other, student)
  with pytest.raises(ValueError, match='vocab_size'):
    student_config(CFG, vocab_size=80)


def test_teacher_checkpoint_with_another_vocabulary_is_refused(tmp_path):
  """A real teacher checkpoint (qjax.pipeline.train) whose vocabulary is not the student's."""
  from configs import tiny_lm  # pylint: disable=g-import-not-at-top
  from qjax import pipeline  # pylint: disable=g-import-not-at-top
  c = tiny_lm.get_config()
  for k, v in {'model.d_model': 32, 'model.num_layers': 1, 'model.num_heads': 2,
               'model.head_dim': 16, 'model.d_ff': 32, 'data.seq_len': 16, 'train.batch': 2,
               'train.steps': 2, 'train.warmup': 1, 'train.eval_windows': 2,
               'checkpoint.every': 2}.items():
    node, leaf = k.split('.')
    c[node][leaf] = v
  pipeline.train(c, str(tmp_path))
  teacher = pipeline.load_teacher(str(tmp_path), Transformer(
      pipeline.model_config(c, 257), rngs=nnx.Rngs(0)))
  assert teacher.config.vocab_size == 257
  student = Transformer(pipeline.model_config(c, 300), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='vocab_size=257 but the student 300'):
    pipeline.load_teacher(str(tmp_path), student)


def _hidden_and_head(key):
  """Hidden states and a linear + tanh-softcapped head standing in for `model.logits`."""
  k1, k2, k3 = jax.random.split(jax.random.key(key), 3)
  x = jax.random.normal(k1, (2, 8, 16))
  h = jax.random.normal(k2, (2, 8, 16))
  w = jax.random.normal(k3, (16, 64)) * 0.5
  return x, h, lambda a: 30.0 * jnp.tanh(a @ w / 30.0)


@pytest.mark.parametrize('chunk', [2, 8])
def test_chunked_loss_and_gradient_equal_the_whole_loss(chunk):
  x, h, head = _hidden_and_head(7)
  labels = jax.random.randint(jax.random.key(8), (2, 8), 0, 64)
  whole = lambda x: distill_loss(head(x), head(h), labels, alpha=0.4, temperature=2.0)
  chunked = lambda x: chunked_distill_loss(head, x, labels, chunk=chunk, teacher_logits=head,
                                           h_BTD=h, alpha=0.4, temperature=2.0)
  (lw, aw), gw = jax.jit(jax.value_and_grad(whole, has_aux=True))(x)
  (lc, ac), gc = jax.jit(jax.value_and_grad(chunked, has_aux=True))(x)
  np.testing.assert_allclose(lc, lw, rtol=1e-6)
  np.testing.assert_allclose(ac['kl'], aw['kl'], rtol=1e-5)
  np.testing.assert_allclose(gc, gw, rtol=1e-5, atol=1e-7)
  # Without a teacher it is the label cross entropy.
  ce = optax.softmax_cross_entropy_with_integer_labels(head(x), labels).mean()
  np.testing.assert_allclose(
      jax.jit(lambda x: chunked_distill_loss(head, x, labels, chunk=chunk)[0])(x), ce, rtol=1e-6)


def test_chunked_loss_bad_input_is_a_clear_value_error():
  x, h, head = _hidden_and_head(9)
  labels = jnp.zeros((2, 8), jnp.int32)
  with pytest.raises(ValueError, match=r'chunk=3 must be an int >= 1 dividing the 8'):
    chunked_distill_loss(head, x, labels, chunk=3)
  with pytest.raises(ValueError, match='both teacher_logits and h_BTD'):
    chunked_distill_loss(head, x, labels, chunk=4, teacher_logits=head)
  with pytest.raises(ValueError, match='no teacher was given'):
    chunked_distill_loss(head, x, labels, chunk=4, alpha=0.5)
