"""A training step that keeps one copy of what it trains: the trained variables and the
optimizer state are donated to the jitted step, everything else is only read.

`nnx.jit` over a whole model returns (and, without donation, copies) its whole state; on
Gemma 3 270M that is a second copy of the ~100M trained weights and their two Adam moments
(1.8 GB) at every step. Donating the whole model is not an option when a frozen array is
shared with another model (the QAT student's tied embedding is the teacher's buffer):
donation would free it under the teacher. Here the model is split by the `wrt` filter:

    step = lean_step(model, optimizer, wrt, loss_fn, frozen=(teacher,))
    for batch in batches:
      loss = step(batch)          # loss_fn(model, teacher, batch); model, optimizer updated

The trained state and the optimizer state are donated (their updated values reuse the
buffers), the model's other variables and the `frozen` modules are passed undonated, and
`model` / `optimizer` are updated in place after each call.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx


def lean_step(model: nnx.Module, optimizer: nnx.Optimizer, wrt,
              loss_fn: Callable[..., jax.Array], *,
              frozen: Sequence[nnx.Module] = ()) -> Callable[..., jax.Array]:
  """A jitted step `step(*args) -> loss` of `loss_fn(model, *frozen, *args)`.

  Args:
    model: the model to train (updated in place by each call).
    optimizer: an `nnx.Optimizer` built over `model` with the same `wrt`.
    wrt: the nnx filter of the trained variables (gradients, optimizer state, donation).
    loss_fn: (model, *frozen modules, *args) -> scalar loss.
    frozen: modules the loss reads but never trains (e.g. a distillation teacher); they may
      share arrays with `model`'s untrained variables.

  Returns:
    step(*args): one optimizer step; returns the loss (a device scalar).
  """
  m_def, _, rest = nnx.split(model, wrt, ...)
  # A trained array that is also an untrained or frozen one (e.g. a model cloned from the
  # teacher: `nnx.clone` shares the immutable arrays) gets its own buffer: donating it would
  # free it under the reader.
  read = {id(a) for a in jax.tree.leaves((rest, [nnx.state(f) for f in frozen]))}
  nnx.update(model, jax.tree.map(lambda a: jnp.copy(a) if id(a) in read else a,
                                 nnx.state(model, wrt)))
  o_def, _ = nnx.split(optimizer)
  f_defs = [nnx.split(f)[0] for f in frozen]
  if not jax.tree.leaves(nnx.state(model, wrt)):
    raise ValueError('lean_step: the filter wrt selects no variable of the model; nothing '
                     'would train (check the filter, e.g. nnx.Param).')

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def pure(trained, opt_state, rest, frozen_states, *args):
    m = nnx.merge(m_def, trained, rest)
    opt = nnx.merge(o_def, opt_state)
    fs = [nnx.merge(d, s) for d, s in zip(f_defs, frozen_states)]
    loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt))(m, *fs, *args)
    opt.update(m, grads)
    return loss, nnx.state(m, wrt), nnx.state(opt)

  def step(*args):
    _, trained, rest = nnx.split(model, wrt, ...)
    loss, trained, opt_state = pure(trained, nnx.state(optimizer), rest,
                                    [nnx.state(f) for f in frozen], *args)
    nnx.update(model, trained)
    nnx.update(optimizer, opt_state)
    return loss

  step.lower = lambda *args: pure.lower(  # for memory_analysis() of the compiled step
      nnx.state(model, wrt), nnx.state(optimizer), nnx.split(model, wrt, ...)[2],
      [nnx.state(f) for f in frozen], *args)
  return step
