"""The training run behind `python -m experiments.train`: config -> data -> model -> optax loop
-> Orbax checkpoints, resumable; and `load_trained`, which every later stage starts from.

Killing a run and calling `train` again with the same workdir resumes from the latest
checkpoint (the batches are a pure function of (seed, step), so the resumed run ends on the
same loss). Writes to workdir: checkpoints/ (Orbax), metrics.jsonl, config.json, final.json.
"""

from __future__ import annotations

import json
import os
import time

from absl import logging
from flax import nnx
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp

from qjax.eval import metrics
from qjax.nn import Transformer, TransformerConfig, param_count
from qjax.train import data as qdata
from qjax.train.optim import make_optimizer


def model_config(config, vocab_size: int) -> TransformerConfig:
  """The TransformerConfig a training config describes (vocab from the tokenizer)."""
  return TransformerConfig(vocab_size=vocab_size, max_len=config.data.seq_len,
                           **config.model.to_dict())


def build(config, mcfg: TransformerConfig):
  """(model, optimizer) for a training config."""
  model = Transformer(mcfg, rngs=nnx.Rngs(config.seed))
  tx = make_optimizer(config.train.lr, config.train.steps, config.train.warmup,
                      config.train.weight_decay, config.train.clip_norm,
                      name=config.train.optimizer)
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def _loss(model, batch_BT1):
  logits_BTV = model(batch_BT1[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, batch_BT1[:, 1:]).mean()


@nnx.jit
def train_step(model, optimizer, batch_BT1):
  """One optimizer step on next-token cross-entropy; returns the loss."""
  loss, grads = nnx.value_and_grad(_loss)(model, batch_BT1)
  optimizer.update(model, grads)
  return loss


def train(config, workdir: str) -> dict:
  """Train (or resume) per `config` in `workdir`.

  Args:
    config: a `configs/tiny_lm.py`-style ConfigDict (data, model, train, checkpoint, seed).
    workdir: where checkpoints and metrics go; an existing run there is resumed.

  Returns:
    The final metrics (also written to workdir/final.json).
  """
  # ---------------------------------------------------------------- data
  data = qdata.load_data(config.data.source, config.data.seq_len, config.data.valid_fraction)
  valid = qdata.eval_windows(data.valid, config.data.seq_len, config.train.eval_windows)
  mcfg = model_config(config, data.tokenizer.vocab_size)

  # ---------------------------------------------------------------- model and optimizer
  model, optimizer = build(config, mcfg)
  logging.info('model: %s parameters, %s', f'{param_count(model):,}', mcfg)

  # ---------------------------------------------------------------- checkpoints (resume)
  os.makedirs(workdir, exist_ok=True)
  mngr = ocp.CheckpointManager(
      os.path.join(os.path.abspath(workdir), 'checkpoints'),
      options=ocp.CheckpointManagerOptions(save_interval_steps=config.checkpoint.every,
                                           max_to_keep=config.checkpoint.keep))
  start = 0
  if mngr.latest_step() is not None:
    start = mngr.latest_step()
    target = {'model': nnx.state(model), 'opt': nnx.state(optimizer)}
    restored = mngr.restore(start, args=ocp.args.StandardRestore(target))
    nnx.update(model, restored['model'])
    nnx.update(optimizer, restored['opt'])
    logging.info('resumed from step %d', start)
    print(f'resumed from checkpoint at step {start}', flush=True)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(config.to_json(indent=2))

  # ---------------------------------------------------------------- train loop
  metrics_path = os.path.join(workdir, 'metrics.jsonl')
  tokens_per_step = config.train.batch * config.data.seq_len
  t0, loss = time.perf_counter(), float('nan')
  for step in range(start, config.train.steps):
    batch = qdata.batch_at(data.train, step, config.train.batch, config.data.seq_len,
                           config.seed)
    loss = float(train_step(model, optimizer, jnp.asarray(batch)))
    done = step + 1
    if not np.isfinite(loss):
      raise FloatingPointError(f'loss became {loss} at step {done}; lower --config.train.lr '
                               f'(now {config.train.lr}).')
    if done % config.checkpoint.every == 0 or done == config.train.steps:
      mngr.save(done, args=ocp.args.StandardSave(
          {'model': nnx.state(model), 'opt': nnx.state(optimizer)}))
    if done % config.train.log_every == 0 or done == config.train.steps:
      elapsed = time.perf_counter() - t0
      rate = (done - start) * tokens_per_step / elapsed
      eta = (config.train.steps - done) * tokens_per_step / rate
      print(f'step {done:5d}/{config.train.steps}  loss {loss:.4f}  {rate:,.0f} tok/s  '
            f'ETA {eta:.0f}s', flush=True)
      with open(metrics_path, 'a') as f:
        f.write(json.dumps({'step': done, 'loss': loss, 'tokens_per_s': rate}) + '\n')
  mngr.wait_until_finished()

  # ---------------------------------------------------------------- evaluation
  ev = metrics.perplexity(model, valid, config.train.eval_batch)
  unigram = metrics.unigram_perplexity(data.train, valid, data.tokenizer.vocab_size)
  final = {'step': config.train.steps, 'train_loss': loss, 'valid_nll': ev['nll'],
           'valid_ppl': ev['ppl'], 'valid_tokens': ev['tokens'], 'unigram_ppl': unigram,
           'params': param_count(model), 'data': data.describe(),
           'seconds': time.perf_counter() - t0}
  print(f'validation perplexity {ev["ppl"]:.3f} (unigram baseline {unigram:.2f}) on '
        f'{ev["tokens"]} tokens', flush=True)
  with open(metrics_path, 'a') as f:
    f.write(json.dumps({'step': config.train.steps, 'valid_ppl': ev['ppl'],
                        'valid_nll': ev['nll']}) + '\n')
  with open(os.path.join(workdir, 'final.json'), 'w') as f:
    json.dump(final, f, indent=2)
  return final


def load_trained(workdir: str):
  """The float model of a finished training run (its latest checkpoint).

  Args:
    workdir: a directory written by `train` (config.json + checkpoints/).

  Returns:
    (model, config, data): the restored Transformer, the run's config, its TextData.
  """
  cfg_path = os.path.join(workdir, 'config.json')
  if not os.path.isfile(cfg_path):
    raise ValueError(f'{workdir!r} holds no training run (no config.json); train first with '
                     'python -m experiments.train --config.workdir=...')
  with open(cfg_path) as f:
    config = ml_collections.ConfigDict(json.load(f))
  data = qdata.load_data(config.data.source, config.data.seq_len, config.data.valid_fraction)
  mcfg = model_config(config, data.tokenizer.vocab_size)
  mngr = ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), 'checkpoints'))
  step = mngr.latest_step()
  if step is None:
    raise ValueError(f'{workdir!r} has no checkpoint; the training run did not save one.')
  abstract = nnx.eval_shape(lambda: build(config, mcfg))
  restored = mngr.restore(step, args=ocp.args.StandardRestore(
      {'model': nnx.state(abstract[0]), 'opt': nnx.state(abstract[1])}))
  model = abstract[0]
  nnx.update(model, restored['model'])
  return model, config, data
