"""qjax.pipeline's PTQ point: evaluation, conversion record, verified reload; bad input."""

import os

import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config, tiny_reference

from configs import quantize as quantize_config
from qjax import checkpoints as qckpt
from qjax import pipeline
from qjax import eval as qeval
from qjax.nn import Transformer, quantize_model


@pytest.fixture(scope='module')
def ref(trained_tiny):
  return tiny_reference(trained_tiny, 6, 2, 2, 8, 8)


def _quant(**kw):
  q = quantize_config.quant_config()
  for k, v in kw.items():
    q[k] = v
  return q


def test_ptq_point_record_and_bit_identical_reload(ref, trained_tiny, tmp_path):
  out = str(tmp_path / 'int4')
  row = pipeline.quantize_and_evaluate(ref, _quant(bits=4, group_size=32), out,
                                   pipeline.base_checkpoint_hash(str(trained_tiny)))
  assert row['reload_bit_identical']
  assert row['weight_format'] == 'int4-g32' and row['name'] == 'rtn-int4-g32'
  assert row['weight_bytes'] < 0.6 * row['float_weight_bytes']
  q_before, q_after = row['quantized_layer_bytes']
  assert q_after < 0.2 * q_before  # 4-bit codes + f32 group scales vs f32
  assert 0.0 <= row['greedy_agreement'] <= 1.0 and row['max_abs_logit_diff'] > 0
  record = qckpt.read_record(out)
  for field in qckpt.REQUIRED_FIELDS:
    assert field in record, field
  assert record['exempt_modules'] == ['embed']
  assert 'none' in record['calibration']['procedure'].lower()
  assert record['runtime']['jax'] and record['hardware']['backend'] == 'cpu'
  assert all(len(h) == 64 for h in record['artifacts'].values()) and record['artifacts']
  loaded, _ = qckpt.load_quantized(out)
  np.testing.assert_array_equal(qeval.logits(loaded, ref.ref_tokens),
                                qeval.logits(quantize_model(ref.model, pipeline.make_policy(
                                    _quant(bits=4, group_size=32)))[0], ref.ref_tokens))


def test_int8_close_to_float_int3_further(ref, tmp_path):
  r8 = pipeline.quantize_and_evaluate(ref, _quant(bits=8), str(tmp_path / 'a'), 'x',
                                  reload_check=False)
  r3 = pipeline.quantize_and_evaluate(ref, _quant(bits=3), str(tmp_path / 'b'), 'x',
                                  reload_check=False)
  assert abs(r8['ppl_delta']) < 0.01 * ref.ppl['ppl']
  assert r3['max_abs_logit_diff'] > r8['max_abs_logit_diff']
  assert r8['greedy_agreement'] >= r3['greedy_agreement']


def test_corrupted_artifact_is_refused(ref, tmp_path):
  out = str(tmp_path / 'q')
  pipeline.quantize_and_evaluate(ref, _quant(bits=8), out, 'x', reload_check=False)
  record = qckpt.read_record(out)
  victim = max(record['artifacts'], key=lambda p: os.path.getsize(os.path.join(out, p)))
  with open(os.path.join(out, victim), 'r+b') as f:
    f.seek(10)
    b = f.read(1)
    f.seek(10)
    f.write(bytes([b[0] ^ 0xFF]))
  with pytest.raises(ValueError, match='sha256 .* but the conversion record says'):
    qckpt.load_quantized(out)
  os.remove(os.path.join(out, victim))
  with pytest.raises(ValueError, match='is missing'):
    qckpt.read_record(out)


def test_missing_dir_and_wrong_architecture(ref, trained_tiny, tmp_path):
  with pytest.raises(ValueError, match='holds no training run'):
    pipeline.load_trained(str(tmp_path / 'nope'))
  with pytest.raises(ValueError, match='no conversion_record.json|has no conversion_record'):
    qckpt.load_quantized(str(tmp_path / 'nope'))
  # A training checkpoint restored into a different architecture.
  other = tiny_config(tmp_path, **{'model.d_model': 48})
  mcfg = pipeline.model_config(other, 257)
  ckpt_dir = str(tmp_path / 'saved')
  qckpt.save_state(ckpt_dir, ref.model)
  with pytest.raises(ValueError, match='does not match the requested architecture'):
    qckpt.restore_state(ckpt_dir, lambda: Transformer(mcfg, rngs=nnx.Rngs(0)))


def test_group_size_not_dividing_a_layer_names_it(ref, tmp_path):
  with pytest.raises(ValueError, match=r"group_size=24 .* layer 'layers/0/attn/[a-z_]+'"):
    pipeline.quantize_and_evaluate(ref, _quant(bits=4, group_size=24), str(tmp_path / 'x'), 'x')


def test_prompt_longer_than_max_len(ref):
  from qjax.nn import greedy_generate  # pylint: disable=g-import-not-at-top
  too_long = np.zeros((1, ref.model.config.max_len + 1), np.int32)
  with pytest.raises(ValueError, match='exceeds config.max_len'):
    greedy_generate(ref.model, too_long, 1)
  with pytest.raises(ValueError, match=str(ref.model.config.max_len)):
    ref.model(too_long)


def test_unused_rule_is_reported_and_strict_raises(ref):
  from qjax.core import int_format  # pylint: disable=g-import-not-at-top
  from qjax.nn import QuantPolicy, QuantRule, quantize_model  # pylint: disable=g-import-not-at-top
  rules = (QuantRule('lm_head_typo', exempt=True), QuantRule('.*', int_format(8)))
  with pytest.warns(UserWarning, match='lm_head_typo'):
    _, report = quantize_model(ref.model, QuantPolicy(rules))
  assert [r.pattern for r in report.unused_rules] == ['lm_head_typo']
  with pytest.raises(ValueError, match='lm_head_typo'):
    quantize_model(ref.model, QuantPolicy(rules, strict=True))
