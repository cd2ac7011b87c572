"""Converted QAT models through save_quantized / load_quantized: PACT clips and KV formats."""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

import qjax.checkpoints
from qjax.checkpoints import REQUIRED_FIELDS, load_quantized, save_quantized
from qjax.checkpoints.records import RECORD_NAME
from qjax.core import int_format
from qjax.nn import QuantPolicy, QuantRule, Transformer, TransformerConfig, einsum_layers, kv_format
from qjax.train import convert, make_optimizer, make_qat_optimizer, prepare_qat, qat_step

CFG = TransformerConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=32, d_ff=64, max_len=32)
W4A8 = QuantPolicy((QuantRule('embed', exempt=True),
                    QuantRule('.*', int_format(4, group_size=16), act=int_format(8))),
                   path='int8')


def _trained(**prepare):
  qat, _ = prepare_qat(Transformer(CFG, rngs=nnx.Rngs(0)), W4A8, learn_scales=True, **prepare)
  opt = make_qat_optimizer(qat, make_optimizer(1e-2, 10, 1), scale_lr=1e-2)
  for i in range(3):
    qat_step(qat, opt, jax.random.randint(jax.random.key(10 + i), (4, 17), 0, CFG.vocab_size))
  return qat


def _record(**fields):
  base = {f: 'none' for f in REQUIRED_FIELDS if f not in ('runtime', 'hardware', 'artifacts')}
  return {**base, 'calibration': {'procedure': 'QAT, 3 steps'}, **fields}


def _logits(m, tokens):
  return np.asarray(nnx.jit(lambda m, t: m(t))(m, tokens))


UP = 'layers/0/mlp/up_proj'
TOKENS = jax.random.randint(jax.random.key(1), (2, 16), 0, CFG.vocab_size)


def test_pact_model_reloads_with_its_clips_bit_for_bit(tmp_path):
  qmodel, _ = convert(_trained(act=True, pact=0.5), W4A8)
  clips = {p: float(l.act_clip[...]) for p, l in einsum_layers(qmodel) if l.act_clip is not None}
  assert len(clips) == 7 and len(set(clips.values())) > 1  # trained apart from 0.5
  save_quantized(str(tmp_path), qmodel, W4A8, _record())
  record = json.load(open(os.path.join(tmp_path, RECORD_NAME)))
  assert sorted(p for p, q in record['einsum_quant'].items() if q['pact']) == sorted(clips)
  assert record['kv_qformat'] is None

  loaded, _ = load_quantized(str(tmp_path))
  got = {p: float(l.act_clip[...]) for p, l in einsum_layers(loaded) if l.act_clip is not None}
  assert got == clips
  np.testing.assert_array_equal(_logits(loaded, TOKENS), _logits(qmodel, TOKENS))
  # The clips matter: the same weights without them give other logits.
  for _, l in einsum_layers(loaded):
    l.quant = l.quant.replace(pact=False)
  assert not np.allclose(_logits(loaded, TOKENS), _logits(qmodel, TOKENS), atol=1e-4)


def test_kv_qat_model_reloads_with_its_kv_format(tmp_path):
  qmodel, _ = convert(_trained(kv='int4'), W4A8)
  with pytest.raises(ValueError, match=r"kv_cache_format.*'float32 \(not quantized\)'.*"
                                       'stores K/V as int4-ch012'):
    save_quantized(str(tmp_path / 'bad'), qmodel, W4A8,
                   _record(kv_cache_format='float32 (not quantized)'))
  save_quantized(str(tmp_path), qmodel, W4A8, _record(kv_cache_format='int4-ch012 (per token)'))
  loaded, record = load_quantized(str(tmp_path))
  assert record['kv_qformat']['bits'] == 4
  assert not any(q['pact'] for q in record['einsum_quant'].values())
  assert kv_format(loaded) == kv_format(qmodel) and kv_format(loaded).name == 'int4-ch012'
  np.testing.assert_array_equal(_logits(loaded, TOKENS), _logits(qmodel, TOKENS))


def test_a_record_naming_a_missing_layer_is_refused(tmp_path):
  qmodel, _ = convert(_trained(act=True, pact=0.5), W4A8)
  save_quantized(str(tmp_path), qmodel, W4A8, _record())
  path = os.path.join(tmp_path, RECORD_NAME)
  record = json.load(open(path))
  record['einsum_quant']['layers/7/mlp/up_proj'] = record['einsum_quant'][UP]
  record['record_sha256'] = qjax.checkpoints.record_sha256(record)  # records are hashed now
  json.dump(record, open(path, 'w'))
  with pytest.raises(ValueError, match=r"einsum_quant describes \['layers/7/mlp/up_proj'\]"):
    load_quantized(str(tmp_path))


def test_a_record_from_before_einsum_quant_still_loads(tmp_path):
  """Older records named the PACT layers ('act_clip_paths') instead of descriptions."""
  qmodel, _ = convert(_trained(act=True, pact=0.5), W4A8)
  save_quantized(str(tmp_path), qmodel, W4A8, _record())
  path = os.path.join(tmp_path, RECORD_NAME)
  record = json.load(open(path))
  record['act_clip_paths'] = [p for p, q in record.pop('einsum_quant').items() if q['pact']]
  record['record_sha256'] = qjax.checkpoints.record_sha256(record)  # records are hashed now
  json.dump(record, open(path, 'w'))
  loaded, _ = load_quantized(str(tmp_path))
  assert all(l.quant == m.quant for (_, l), (_, m) in zip(einsum_layers(loaded),
                                                          einsum_layers(qmodel)))
  np.testing.assert_array_equal(_logits(loaded, TOKENS), _logits(qmodel, TOKENS))


def test_a_record_with_an_unknown_description_field_is_refused(tmp_path):
  qmodel, _ = convert(_trained(act=True, pact=0.5), W4A8)
  save_quantized(str(tmp_path), qmodel, W4A8, _record())
  path = os.path.join(tmp_path, RECORD_NAME)
  record = json.load(open(path))
  record['einsum_quant'][UP]['hqq'] = True
  record['record_sha256'] = qjax.checkpoints.record_sha256(record)  # records are hashed now
  json.dump(record, open(path, 'w'))
  with pytest.raises(ValueError, match=r"einsum_quant of 'layers/0/mlp/up_proj'.*unknown fields "
                                       r"\['hqq'\]"):
    load_quantized(str(tmp_path))
