"""The training run behind `python -m experiments.train`: config -> data -> model -> optax loop
-> Orbax checkpoints, resumable; and `load_trained`, which every later stage starts from.

Killing a run and calling `train` again with the same workdir resumes from the latest
checkpoint (the batches are a pure function of (seed, step), so the resumed run ends on the
same loss). Writes to workdir: checkpoints/ (Orbax), metrics.jsonl, config.json, final.json.
"""

from __future__ import annotations

import json
import math
import os
import time

from absl import logging
from flax import nnx
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp

from qjax import checkpoints as qckpt
from qjax.eval import metrics
from qjax.nn import Transformer, TransformerConfig, param_count
from qjax.train import data as qdata
from qjax.pipeline import manifest as manifest_lib
from qjax.train.optim import make_optimizer
from qjax.train.workdir import workdir_lock


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


def check_train_config(config) -> None:
  """Refuse training settings that would fail late, cryptically, or train silently wrong.

  Raises:
    ValueError: naming the field, its value and the fix.
  """
  t, c = config.train, config.checkpoint
  for name, value in (('train.steps', t.steps), ('train.batch', t.batch),
                      ('train.log_every', t.log_every), ('checkpoint.every', c.every),
                      ('checkpoint.keep', c.keep), ('data.seq_len', config.data.seq_len)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f'--config.{name}={value!r} must be a positive integer.')
  if not (isinstance(t.lr, (int, float)) and math.isfinite(t.lr) and t.lr > 0):
    raise ValueError(f'--config.train.lr={t.lr!r} must be a finite number > 0 (a learning '
                     'rate <= 0 trains uphill or not at all); e.g. 3e-3.')


def _trim_metrics(path: str, start: int) -> None:
  """Keep the training lines of steps <= `start` (a resume replays the rest; a finished run
  re-evaluates), one per step (a line is keyed by its step: the last written wins), so a
  rerun never duplicates a line; a torn last line goes too."""
  if not os.path.isfile(path):
    return
  kept = {}
  with open(path) as f:
    for line in f:
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(row, dict) and 'loss' in row and row.get('step', start + 1) <= start:
        kept[row['step']] = json.dumps(row) + '\n'
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    f.writelines(kept[step] for step in sorted(kept))
  os.replace(tmp, path)


def _resume(config, workdir, mngr, target, prov):
  """(start step, its manifest or None, restored state or None), after verifying it."""
  step, unvouched = manifest_lib.resumable_step(workdir, mngr.all_steps())
  for s in unvouched:  # saves a kill cut before their manifest: never trusted, replayed
    logging.warning('checkpoint %d has no manifest (interrupted save): deleting it', s)
    mngr.delete(s)
  if step is None:
    return 0, None, None
  manifest = manifest_lib.verify_checkpoint(workdir, step)
  changes = manifest_lib.provenance_changes(manifest['provenance'], prov)
  if changes:
    if not config.checkpoint.get('allow_config_change', False):
      raise ValueError(f'{workdir!r} holds a run with another config or data, so resuming it '
                       f'would mix two runs: {changes}. Train into a new workdir, or pass '
                       '--config.checkpoint.allow_config_change=True to continue it '
                       'deliberately (the change is recorded in provenance.jsonl).')
    with open(os.path.join(workdir, 'provenance.jsonl'), 'a') as f:
      f.write(json.dumps({'resumed_at_step': step, 'changes': changes,
                          'config_sha256': prov['config_sha256'],
                          'data_sha256': prov['data_sha256']}) + '\n')
  restored = mngr.restore(step, args=ocp.args.StandardRestore(target))
  got = qckpt.content_sha256(restored)
  if got != manifest['content_sha256']:
    raise ValueError(f'checkpoint {step} of {workdir!r} restored arrays with content_sha256 '
                     f"{got[:16]}..., but its manifest says {manifest['content_sha256'][:16]}"
                     '...: retrain into a new workdir.')
  return step, manifest, restored


def train(config, workdir: str) -> dict:
  """Train (or resume) per `config` in `workdir`.

  A resume verifies the checkpoint against its manifest and refuses another config or data
  (unless `config.checkpoint.allow_config_change`, recorded in provenance.jsonl).

  Args:
    config: a `configs/tiny_lm.py`-style ConfigDict (data, model, train, checkpoint, seed).
    workdir: where checkpoints and metrics go; an existing run there is resumed. A run
      holds its lock (`qjax.train.workdir`) until it returns: a second run on the same
      workdir is refused, naming the first.

  Returns:
    The final metrics (also written to workdir/final.json).
  """
  check_train_config(config)
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f'workdir {workdir!r} is a file; pass a directory.')
  with workdir_lock(workdir):
    return _train(config, workdir)


def _train(config, workdir: str) -> dict:
  """`train` once the workdir's lock is held."""
  # ---------------------------------------------------------------- data
  data = qdata.load_data(config.data.source, config.data.seq_len, config.data.valid_fraction)
  valid = qdata.eval_windows(data.valid, config.data.seq_len, config.train.eval_windows)
  mcfg = model_config(config, data.tokenizer.vocab_size)
  prov = manifest_lib.provenance(config, data.sha256)

  # ---------------------------------------------------------------- model and optimizer
  model, optimizer = build(config, mcfg)
  logging.info('model: %s parameters, %s', f'{param_count(model):,}', mcfg)

  # ---------------------------------------------------------------- checkpoints (resume)
  mngr = ocp.CheckpointManager(
      os.path.join(os.path.abspath(workdir), 'checkpoints'),
      options=ocp.CheckpointManagerOptions(save_interval_steps=config.checkpoint.every,
                                           max_to_keep=config.checkpoint.keep))
  start, manifest, restored = _resume(
      config, workdir, mngr, {'model': nnx.state(model), 'opt': nnx.state(optimizer)}, prov)
  if restored is not None:
    nnx.update(model, restored['model'])
    nnx.update(optimizer, restored['opt'])
    logging.info('resumed from step %d', start)
    print(f'resumed from checkpoint at step {start}', flush=True)
  if restored is None or manifest['provenance'] != prov:
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      f.write(config.to_json(indent=2))

  # ---------------------------------------------------------------- train loop
  metrics_path = os.path.join(workdir, 'metrics.jsonl')
  _trim_metrics(metrics_path, start)
  tokens_per_step = config.train.batch * config.data.seq_len
  t0 = time.perf_counter()
  loss = manifest['train_loss'] if manifest else float('nan')
  for step in range(start, config.train.steps):
    batch = qdata.batch_at(data.train, step, config.train.batch, config.data.seq_len,
                           config.seed)
    loss = float(train_step(model, optimizer, jnp.asarray(batch)))
    done = step + 1
    if not np.isfinite(loss):
      raise FloatingPointError(f'loss became {loss} at step {done}; lower --config.train.lr '
                               f'(now {config.train.lr}).')
    # The line goes first, the checkpoint second: a kill between them is replayed from the
    # previous checkpoint (and the line trimmed), never left without its line.
    if done % config.train.log_every == 0 or done == config.train.steps:
      elapsed = time.perf_counter() - t0
      rate = (done - start) * tokens_per_step / elapsed
      eta = (config.train.steps - done) * tokens_per_step / rate
      print(f'step {done:5d}/{config.train.steps}  loss {loss:.4f}  {rate:,.0f} tok/s  '
            f'ETA {eta:.0f}s', flush=True)
      with open(metrics_path, 'a') as f:
        f.write(json.dumps({'step': done, 'loss': loss, 'tokens_per_s': rate}) + '\n')
    if done % config.checkpoint.every == 0 or done == config.train.steps:
      state = {'model': nnx.state(model), 'opt': nnx.state(optimizer)}
      mngr.save(done, args=ocp.args.StandardSave(state))
      mngr.wait_until_finished()  # the manifest hashes the finalized files
      manifest_lib.write_manifest(workdir, done, state, loss, prov, mngr.all_steps())
  mngr.wait_until_finished()

  # ---------------------------------------------------------------- evaluation
  ev = metrics.perplexity(model, valid, config.train.eval_batch)
  unigram = metrics.unigram_perplexity(data.train, valid, data.tokenizer.vocab_size)
  final = {'step': config.train.steps, 'train_loss': loss, 'valid_nll': ev['nll'],
           'valid_ppl': ev['ppl'], 'valid_tokens': ev['tokens'], 'unigram_ppl': unigram,
           'params': param_count(model), 'data': data.describe(),
           'config_sha256': prov['config_sha256'], 'seconds': time.perf_counter() - t0}
  print(f'validation perplexity {ev["ppl"]:.3f} (unigram baseline {unigram:.2f}) on '
        f'{ev["tokens"]} tokens', flush=True)
  with open(metrics_path, 'a') as f:
    f.write(json.dumps({'step': config.train.steps, 'valid_ppl': ev['ppl'],
                        'valid_nll': ev['nll']}) + '\n')
  with open(os.path.join(workdir, 'final.json'), 'w') as f:
    json.dump(final, f, indent=2)
  return final


def _read_config(workdir: str):
  cfg_path = os.path.join(workdir, 'config.json')
  if not os.path.isfile(cfg_path):
    raise ValueError(f'{workdir!r} holds no training run (no config.json); train first with '
                     'python -m experiments.train --config.workdir=...')
  try:
    with open(cfg_path) as f:
      return ml_collections.ConfigDict(json.load(f))
  except json.JSONDecodeError as e:
    raise ValueError(f'{cfg_path}: not valid JSON ({e}); the run directory is corrupted: '
                     'retrain.') from None


def trained_checkpoint(workdir: str, allow_unfinished: bool = False) -> dict:
  """The latest checkpoint of a training run, verified against its manifest.

  Args:
    workdir: a directory written by `train`.
    allow_unfinished: accept a run whose latest checkpoint is before `train.steps`.

  Returns:
    {'step', 'steps', 'finished', 'sha256' (one digest over the checkpoint's files),
    'content_sha256' (of its arrays: equal for bit-identical runs), 'config_sha256',
    'data_sha256'}: what a conversion record states as its base checkpoint.

  Raises:
    ValueError: no checkpoint, a corrupted one, or an unfinished run (unless allowed).
  """
  config = _read_config(workdir)
  mngr = ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), 'checkpoints'))
  step = mngr.latest_step()
  if step is None:
    raise ValueError(f'{workdir!r} has no checkpoint; the training run did not save one.')
  manifest = manifest_lib.verify_checkpoint(workdir, step)
  steps = int(config.train.steps)
  if step < steps and not allow_unfinished:
    raise ValueError(f'{workdir!r}: the latest checkpoint is step {step} of {steps}: the '
                     'training run did not finish. Resume it (run the same train command), or '
                     'pass --config.allow_unfinished=True to use this checkpoint (the record '
                     'then states the step).')
  return {'step': step, 'steps': steps, 'finished': step >= steps,
          'sha256': qckpt.digest(manifest['files']), 'content_sha256': manifest['content_sha256'],
          'config_sha256': manifest['provenance']['config_sha256'],
          'data_sha256': manifest['provenance']['data_sha256']}


def load_trained(workdir: str, allow_unfinished: bool = False):
  """The float model of a finished training run (its latest checkpoint, verified).

  Args:
    workdir: a directory written by `train` (config.json + checkpoints/ + manifests/).
    allow_unfinished: accept a run that stopped before `train.steps` (see
      `trained_checkpoint`).

  Returns:
    (model, config, data): the restored Transformer, the run's config, its TextData.

  Raises:
    ValueError: see `trained_checkpoint`; also when the restored arrays differ from the
      manifest's content hash.
  """
  info = trained_checkpoint(workdir, allow_unfinished)
  config = _read_config(workdir)
  data = qdata.load_data(config.data.source, config.data.seq_len, config.data.valid_fraction)
  if data.sha256 != info['data_sha256']:
    raise ValueError(f'{workdir!r} was trained on data with sha256 {info["data_sha256"][:16]}'
                     f'..., but {config.data.source!r} now gives {data.sha256[:16]}...: the data '
                     'file changed since training; restore it or retrain.')
  mcfg = model_config(config, data.tokenizer.vocab_size)
  mngr = ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), 'checkpoints'))
  abstract = nnx.eval_shape(lambda: build(config, mcfg))
  restored = mngr.restore(info['step'], args=ocp.args.StandardRestore(
      {'model': nnx.state(abstract[0]), 'opt': nnx.state(abstract[1])}))
  if qckpt.content_sha256(restored) != info['content_sha256']:
    raise ValueError(f'checkpoint {info["step"]} of {workdir!r}: the restored arrays differ '
                     "from its manifest's content hash; retrain.")
  model = abstract[0]
  nnx.update(model, restored['model'])
  return model, config, data
