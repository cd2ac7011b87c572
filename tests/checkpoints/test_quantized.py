"""save_quantized / load_quantized of PTQ models whose layers carry more than a QWeight."""

import json
import os
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

import qjax.checkpoints
from qjax.algorithms import apply_method
from qjax.checkpoints import REQUIRED_FIELDS, load_quantized, save_quantized
from qjax.checkpoints.records import RECORD_NAME
from qjax.core import int_format
from qjax.nn import QuantPolicy, QuantRule, Transformer, TransformerConfig, einsum_layers

CFG = TransformerConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=16, d_ff=64, max_len=16)
W8 = QuantPolicy((QuantRule('embed', exempt=True), QuantRule('.*', int_format(8))))
W8A8 = QuantPolicy((QuantRule('embed', exempt=True),
                    QuantRule('.*', int_format(8), act=int_format(8))))
TOKENS = jax.random.randint(jax.random.key(1), (2, 16), 0, CFG.vocab_size)


def _record(calibration):
  base = {f: 'none' for f in REQUIRED_FIELDS if f not in ('runtime', 'hardware', 'artifacts')}
  return {**base, 'calibration': calibration}


def _logits(m):
  return np.asarray(nnx.jit(lambda m, t: m(t))(m, TOKENS))


def test_checkpoints_do_not_import_algorithms():
  for f in pathlib.Path(qjax.checkpoints.__path__[0]).glob('*.py'):
    assert 'qjax.algorithms' not in f.read_text(), f.name


@pytest.mark.parametrize('method,policy,options,field', [
    ('llm_int8', W8, {'threshold': 1.0}, 'outlier_threshold'),
    ('smoothquant', W8A8, {'fold_linear': False}, 'input_scale')])
@pytest.mark.parametrize('old_record', [False, True], ids=['record', 'record_before_v2'])
def test_ptq_structure_reloads_bit_for_bit(tmp_path, method, policy, options, field, old_record):
  model = Transformer(CFG, rngs=nnx.Rngs(0))
  calib = np.asarray(jax.random.randint(jax.random.key(2), (4, 16), 0, CFG.vocab_size))
  qmodel, _, calibration = apply_method(model, policy, method, calib, options)
  save_quantized(str(tmp_path), qmodel, policy, _record(calibration))
  path = os.path.join(tmp_path, RECORD_NAME)
  record = json.load(open(path))
  changed = sorted(p for p, q in record['einsum_quant'].items() if q[field])
  assert changed and changed == sorted(calibration['structure'])
  if old_record:  # written before 'einsum_quant': rebuilt from calibration.structure
    del record['einsum_quant']
    record['record_sha256'] = qjax.checkpoints.record_sha256(record)  # records are hashed now
    json.dump(record, open(path, 'w'))
  loaded, _ = load_quantized(str(tmp_path))
  for (p, l), (_, m) in zip(einsum_layers(loaded), einsum_layers(qmodel)):
    assert l.quant == m.quant, p
  np.testing.assert_array_equal(_logits(loaded), _logits(qmodel))


def test_load_builds_the_skeleton_abstractly(tmp_path, monkeypatch):
  """The reload never holds a float (or any) copy of the weights before the restore: the
  skeleton's leaves are abstract (traced, no buffers) and the restored ones are the saved
  quantized arrays."""
  from qjax.checkpoints import quantized  # pylint: disable=g-import-not-at-top
  from qjax.nn import quantize_model  # pylint: disable=g-import-not-at-top
  policy = QuantPolicy((QuantRule('.*', int_format(4, group_size=16)),))
  qmodel = quantize_model(Transformer(CFG, rngs=nnx.Rngs(0)), policy)[0]
  save_quantized(str(tmp_path), qmodel, policy, _record('none'))
  built = []
  real = quantized.skeleton

  def spy(record):
    model = real(record)
    built.append([type(x) for x in jax.tree.leaves(nnx.state(model))])
    return model
  monkeypatch.setattr(quantized, 'skeleton', spy)
  loaded, _ = load_quantized(str(tmp_path))
  assert len(built) == 1 and built[0]
  assert all(issubclass(t, jax.core.Tracer) for t in built[0]), set(built[0])
  leaves = jax.tree.leaves(nnx.state(loaded))
  assert all(isinstance(x, jax.Array) for x in leaves)
  assert sum(x.nbytes for x in leaves) == sum(x.nbytes for x in jax.tree.leaves(
      nnx.state(qmodel)))
  np.testing.assert_array_equal(_logits(loaded), _logits(qmodel))
