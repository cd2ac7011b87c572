"""Custom models and chips from specs, kv-head padding and the 'additive' combining rule."""

import os
import pathlib
import subprocess
import sys

import pytest

from qjax import costmodel

ROOT = pathlib.Path(__file__).resolve().parents[2]
W = costmodel.Workload(batch=8, prompt_len=512, gen_len=16)


def test_a_shape_spec_equals_the_preset():
  spec = dict(name='g', n_layers=18, d_model=640, d_ff=2048, n_heads=4, head_dim=256,
              n_kv_heads=1, vocab=262144, glu=True)
  custom = costmodel.model_from_spec(spec)
  preset = costmodel.get_model('gemma3_270m')
  assert custom.n_params == preset.n_params and custom.kv_bytes_per_token() == (
      preset.kv_bytes_per_token())
  a = costmodel.estimate(custom, 'h200', '1x1x1', '1d_ws+mq_batch', W, 'decode')
  b = costmodel.estimate(preset, 'h200', '1x1x1', '1d_ws+mq_batch', W, 'decode')
  assert a.step_latency_s == b.step_latency_s and a.memory.total_bytes == b.memory.total_bytes


def test_a_totals_spec_keeps_the_totals():
  preset = costmodel.get_model('gemma3_270m')
  tot = costmodel.model_from_spec(dict(
      n_params=preset.n_params, kv_bytes_per_token=preset.kv_bytes_per_token(16),
      n_layers=18, d_model=640, vocab=262144))
  assert isinstance(tot, costmodel.TotalsShape)
  assert tot.n_params == preset.n_params
  assert tot.kv_bytes_per_token(8) == preset.kv_bytes_per_token(8)
  a = costmodel.estimate(tot, 'h200', '1x1x1', '1d_ws+mq_batch', W, 'decode')
  b = costmodel.estimate(preset, 'h200', '1x1x1', '1d_ws+mq_batch', W, 'decode')
  assert a.memory.weights_bytes == pytest.approx(b.memory.weights_bytes)
  assert a.memory.kv_bytes == pytest.approx(b.memory.kv_bytes)
  assert a.layer.weight_load_s == pytest.approx(b.layer.weight_load_s)


def test_bad_specs_name_the_key():
  with pytest.raises(ValueError, match=r"unknown key\(s\) \['layers'\]"):
    costmodel.model_from_spec(dict(layers=3, d_model=8))
  with pytest.raises(ValueError, match='missing'):
    costmodel.model_from_spec(dict(n_layers=3, d_model=8))
  with pytest.raises(ValueError, match='missing'):
    costmodel.chip_from_spec(dict(name='x', bf16_flops=1e12))


def test_a_custom_chip_equals_the_preset():
  h = costmodel.get_chip('h200')
  spec = dict(name='mine', bf16_flops=h.bf16_flops, int8_flops=h.int8_flops,
              fp8_flops=h.fp8_flops, hbm_bytes=h.hbm_bytes, hbm_bw=h.hbm_bw, ici_bw=h.ici_bw,
              ici_links=h.ici_links, topology=h.topology, domain_size=h.domain_size,
              scaleout_bw=h.scaleout_bw)
  a = costmodel.estimate('gemma3_270m', costmodel.chip_from_spec(spec), '1x1x1',
                         '1d_ws+mq_batch', W, 'decode')
  b = costmodel.estimate('gemma3_270m', 'h200', '1x1x1', '1d_ws+mq_batch', W, 'decode')
  assert a.step_latency_s == b.step_latency_s


def test_additive_rule_adds_every_term():
  ests = {c: costmodel.estimate('palm_540b', 'tpu_v4', '4x4x4', '2d_ws+mq_batch',
                                costmodel.Workload(64, 2048, 64, weight_bits=8), 'decode',
                                combine=c) for c in costmodel.COMBINE_RULES}
  e = ests['additive']
  compute = e.n_layers * e.layer.compute_s + e.head.compute_s
  memory = e.n_layers * e.layer.memory_s + e.head.memory_s
  comm = e.n_layers * e.layer.comm_s + e.head.comm_s
  assert e.step_latency_s == pytest.approx(compute + memory + comm)
  assert ests['overlap'].step_latency_s <= ests['serial'].step_latency_s <= e.step_latency_s


def test_pad_kv_heads_lets_multihead_split_fewer_kv_heads():
  m = costmodel.model_from_spec(dict(name='gqa', n_layers=4, d_model=1024, d_ff=4096,
                                     n_heads=8, head_dim=128, n_kv_heads=2, vocab=1000))
  w = costmodel.Workload(batch=8, prompt_len=128, gen_len=8)
  with pytest.raises(ValueError, match='pad_kv_heads=True'):
    costmodel.estimate(m, 'tpu_v4', '8x1x1', costmodel.Layout('1d_ws', 'multihead'), w,
                       'decode')
  est = costmodel.estimate(m, 'tpu_v4', '8x1x1',
                           costmodel.Layout('1d_ws', 'multihead', pad_kv_heads=True), w,
                           'decode')
  assert est.plan.model.n_kv_heads == 8  # padded from 2 to the 8 shards
  # The cache is 4x the unpadded model's, split over 8 chips.
  assert est.memory.kv_bytes == pytest.approx(
      w.batch * (w.prompt_len + w.gen_len) * m.kv_bytes_per_token() * 4 / 8)


def test_plan_script_runs_a_custom_config(tmp_path):
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu')
  out = subprocess.run(
      [sys.executable, '-m', 'experiments.plan', f'--config={ROOT / "configs/plan_custom.py"}',
       '--config.plot_batches=(1, 16)', f'--config.out_dir={tmp_path}',
       '--config.combine=additive', '--config.pad_kv_heads=True'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert 'llama3_8b_like on 8 x accel_48g' in out.stdout
  assert 'combining rule: additive (compute + memory + comm (no overlap))' in out.stdout
  assert 'kv heads padded to the shard count: True' in out.stdout
