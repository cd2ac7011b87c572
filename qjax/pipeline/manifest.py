"""Training-checkpoint manifests: what a checkpoint holds, verified before it is restored.

When `train` saves step N it writes `<workdir>/manifests/step_N.json` once Orbax has
finalized the checkpoint: the sha256 of every file of `checkpoints/N/`, the content hash of
the saved arrays (`qjax.checkpoints.content_sha256`, reproducible across runs), the training
loss at N, and the run's provenance (a hash of the config fields that change the result and
of the data). A resume or a quantization verifies the manifest first, so flipped bytes are
an error instead of a silently corrupted model, and a resume with another config is refused.
"""

from __future__ import annotations

import hashlib
import json
import os

from qjax import checkpoints as qckpt

MANIFEST_DIR = 'manifests'
# The config fields a training run's numbers depend on (a config may hold more sections, e.g.
# demo.py's quant and eval, which training never reads) ...
PROVENANCE = ('seed', 'data.', 'model.', 'train.')
# ... but not how often it logs or how it is evaluated.
NOT_PROVENANCE = ('train.log_every', 'train.eval_windows', 'train.eval_batch')


def _matches(key: str, prefixes) -> bool:
  return any(key == p or (p.endswith('.') and key.startswith(p)) for p in prefixes)


def _flat(d: dict, prefix: str = '') -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f'{prefix}{k}.'))
    else:
      out[f'{prefix}{k}'] = v
  return out


def provenance(config, data_sha256: str) -> dict:
  """The provenance of a training run: the config fields that shape it, and its data.

  Args:
    config: the training ConfigDict.
    data_sha256: the token ids' sha256 (`TextData.sha256`).

  Returns:
    {'config': {dotted key: value}, 'config_sha256': ..., 'data_sha256': ...}.
  """
  flat = {k: v for k, v in _flat(json.loads(config.to_json())).items()
          if _matches(k, PROVENANCE) and not _matches(k, NOT_PROVENANCE)}
  sha = hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()
  return {'config': flat, 'config_sha256': sha, 'data_sha256': data_sha256}


def provenance_changes(old: dict, new: dict) -> list[str]:
  """'key: old -> new' for every provenance field that differs (the data as 'data')."""
  a, b = old.get('config', {}), new.get('config', {})
  out = [f'{k}: {a.get(k, "<absent>")!r} -> {b.get(k, "<absent>")!r}'
         for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
  if old.get('data_sha256') != new.get('data_sha256'):
    out.append(f'data: sha256 {str(old.get("data_sha256"))[:12]}... -> '
               f'{str(new.get("data_sha256"))[:12]}...')
  return out


def manifest_path(workdir: str, step: int) -> str:
  return os.path.join(workdir, MANIFEST_DIR, f'step_{step}.json')


def step_dir(workdir: str, step: int) -> str:
  return os.path.join(workdir, 'checkpoints', str(step))


def write_manifest(workdir: str, step: int, state, loss: float, prov: dict,
                   keep_steps) -> dict:
  """Write step `step`'s manifest (after Orbax finalized it); drop those of deleted steps.

  Args:
    workdir: the training run's directory.
    step: the saved step.
    state: the saved pytree (hashed by content).
    loss: the training loss at `step` (a rerun of a finished run reports it).
    prov: `provenance(config, data)`.
    keep_steps: the steps Orbax still keeps (manifests of the others are removed).

  Returns:
    The manifest.
  """
  manifest = {'step': step, 'files': qckpt.tree_sha256(step_dir(workdir, step)),
              'content_sha256': qckpt.content_sha256(state), 'train_loss': loss,
              'provenance': prov}
  path = manifest_path(workdir, step)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    json.dump(manifest, f, indent=1, sort_keys=True)
  os.replace(tmp, path)
  keep = {int(s) for s in keep_steps} | {step}
  for name in os.listdir(os.path.dirname(path)):
    if name.startswith('step_') and name.endswith('.json'):
      if int(name[5:-5]) not in keep:
        os.remove(os.path.join(os.path.dirname(path), name))
  return manifest


def read_manifest(workdir: str, step: int) -> dict | None:
  """The manifest of `step`, or None when it was never written."""
  path = manifest_path(workdir, step)
  if not os.path.isfile(path):
    return None
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f'{path}: not valid JSON ({e}); the manifest is corrupted. Retrain, or '
                     'delete this step from checkpoints/ and its manifest.') from None


def verify_checkpoint(workdir: str, step: int) -> dict:
  """Check checkpoint `step` of `workdir` against its manifest, file by file.

  Returns:
    The manifest.

  Raises:
    ValueError: no manifest, or a file missing, added or changed (named).
  """
  manifest = read_manifest(workdir, step)
  if manifest is None:
    raise ValueError(f'checkpoint {step} of {workdir!r} has no manifest '
                     f'({manifest_path(workdir, step)}): it was written by an older qjax or '
                     'its save was interrupted, so its integrity cannot be checked. Retrain '
                     'into a new workdir.')
  what = f'checkpoint {step} of {workdir!r}'
  qckpt.check_tree_hashes(
      step_dir(workdir, step), manifest['files'],
      missing=lambda rel: (f'{what}: file {rel!r} listed in its manifest is missing; the '
                           'checkpoint is incomplete (retrain or restore it).'),
      changed=lambda rel, got, want: (
          f'{what}: file {rel!r} has sha256 {got[:16]}... but its manifest says '
          f'{want[:16]}...: the checkpoint is corrupted (retrain or restore the file).'),
      extra=lambda rels: (f'{what} holds files its manifest does not list: {rels[:5]}; '
                          'remove them or retrain.'))
  return manifest


def resumable_step(workdir: str, steps) -> tuple[int | None, list[int]]:
  """(the latest step with a manifest, the later steps without one).

  A step without a manifest newer than every manifested one is a save a kill interrupted
  after Orbax finalized it: it is never vouched for, so the caller deletes it and replays.

  Raises:
    ValueError: checkpoints exist but none has a manifest and no manifest directory exists
      (a run written before manifests: its integrity cannot be checked).
  """
  steps = sorted(int(s) for s in steps)
  if steps and not os.path.isdir(os.path.join(workdir, MANIFEST_DIR)):
    raise ValueError(f'{workdir!r} holds checkpoints {steps} but no {MANIFEST_DIR}/ (written '
                     'by an older qjax, or copied without it): they cannot be verified. Train '
                     'into a new workdir.')
  for i in range(len(steps) - 1, -1, -1):
    if read_manifest(workdir, steps[i]) is not None:
      return steps[i], steps[i + 1:]
  return None, steps
