"""benchmarks/device_check.py in its smoke mode: every part of the check runs (a NameError or
a changed API fails here, not on the accelerator), it compiles only the programs it times, and
what it writes holds real numbers beside the compiler's predictions for them."""

import json
import sys

import jax
import jax.numpy as jnp
import pytest

from benchmarks import check_models, device_check, device_env, predicted
from qjax import costmodel


@pytest.mark.plots
def test_smoke_run_writes_json_markdown_and_plot(tmp_path):
  result = device_check.main(['--smoke', '--formats=bf16,w8a8', '--engine=w8a8', '--hf=no',
                              '--threads=2', f'--out={tmp_path}'])
  saved = json.loads((tmp_path / 'device_check.json').read_text())
  assert [(r['model'], r['format']) for r in saved['rows']] == [
      ('llama32_1b', 'bf16'), ('gemma3_270m', 'bf16'), ('llama32_1b', 'w8a8'),
      ('gemma3_270m', 'w8a8')]
  assert saved['environment']['backend'] == result['environment']['backend']
  for r in saved['rows']:
    assert 'error' not in r, r
    assert r['weight_bytes'] > 0 and r['prefill_tok_s'] > 0 and r['compile_s'] > 0
    for b in (1, 2):
      assert r[f'b{b}']['device_loop_ms'] > 0
    assert r['b1']['host_loop_ms'] > 0 and 'host_loop_ms' not in r['b2']  # --host_batches=1
    # The programs it times, nothing else: prefill, the host loop's step, a loop per batch;
    # the predictions and the step's temp bytes come from those executables, and nothing
    # compiles while a program is timed.
    assert r['executables'] == 4 and r['xla_compiles'] > 0
    assert r['prediction_compiles'] == 0 and r['compiles_while_timed'] == 0
    assert set(r['predicted']) == {'prefill', 'step_b1', 'loop_b1', 'loop_b2'}
    assert r['decode_step_temp_bytes'] == r['predicted']['step_b1']['temp_bytes'] > 0
    # On CPU: the compiler's bytes and flops, no roofline (no chip preset).
    pairs = r['measured_vs_predicted']
    assert [x['program'] for x in pairs] == [
        'prefill 32', 'host loop b1 (greedy_step)', 'device loop b1 (decode_steps)',
        'device loop b2 (decode_steps)']
    for x in pairs:
      assert x['measured_ms'] > 0 and x['bytes_accessed'] > 0 and x['flops'] > 0
      assert x['predicted_ms'] is None and x['measured_over_predicted'] is None
    pred = r['predicted']
    if r['format'] == 'bf16':  # XLA dots throughout (W8A8 decodes on the CPU kernel, whose
      # work XLA's cost analysis does not see). A prefill of 32 tokens does about 32 decode
      # steps' flops; the loop's figures are one step's (XLA counts its body once).
      assert 10 < pred['prefill']['flops'] / pred['step_b1']['flops'] < 40
      assert 0.8 < pred['loop_b1']['flops'] / pred['step_b1']['flops'] < 1.25
    assert pred['step_b1']['hlo_bytes'] >= r['weight_bytes'] // 2
  by = {(r['model'], r['format']): r for r in saved['rows']}
  # int8 codes + scales take about half the bytes of bf16 (the norms stay bf16).
  assert by['llama32_1b', 'w8a8']['weight_bytes'] < 0.6 * by['llama32_1b', 'bf16']['weight_bytes']
  # The serving engine at 8 rows, W8A8 weights over an int8 paged KV, beside the bare loop.
  assert [(r['model'], r['format'], r['kv']) for r in saved['engine']] == [
      ('llama32_1b', 'w8a8', 'int8'), ('gemma3_270m', 'w8a8', 'int8')]
  for r in saved['engine']:
    assert 'error' not in r, r
    assert r['rows'] == 8 and r['decode_block'] == 2
    assert r['engine']['tokens'] == 8 * 4 and r['engine']['steps'] == 4
    assert r['engine']['tok_s'] > 0 and r['bare_loop']['tok_s'] > 0
    assert r['compiles_while_timed'] == 0 and r['prediction_compiles'] == 0
    assert r['predicted']['engine_block']['bytes_accessed'] > 0
    assert [x['program'] for x in r['measured_vs_predicted']] == [
        'engine b8, decode block of 2', 'bare decode_steps loop b8']
    assert r['hf'] == {'skipped': 'HF: not asked for (--hf=no)'}
  cache = saved['environment']['compilation_cache']
  assert cache['xla_compiles'] > 0
  if not jax.config.jax_enable_compilation_cache:  # the suite turns it off under jaxlib 0.12
    assert cache['dir'] is None and cache['off'] == 'jax_enable_compilation_cache is false'
  else:
    assert cache['dir'] == str(tmp_path / 'compile_cache')
    assert any((tmp_path / 'compile_cache').iterdir())
  text = (tmp_path / 'device_check.md').read_text()
  assert '## llama32_1b' in text and '## gemma3_270m' in text and '| w8a8 |' in text
  assert '## Serving engine at 8 rows' in text and '| gemma3_270m | w8a8 | int8 |' in text
  assert "## Measured beside the compiler's prediction" in text
  assert '| llama32_1b bf16 | device loop b2 (decode_steps) |' in text
  assert '| gemma3_270m engine w8a8 (KV int8) | engine b8, decode block of 2 |' in text
  assert (tmp_path / 'device_check.png').read_bytes()[:4] == b'\x89PNG'
  att = saved['attention']  # the attention section: every cell of both models ran
  assert [(r['model'], r['kv']) for r in att['decode']] == [('llama32_1b', 'int8'),
                                                            ('gemma3_270m', 'int8')]
  assert all(r['before']['ms'] > 0 for r in att['prefill'] + att['decode'])
  assert '## Attention' in text and '### Paged decode attention' in text

  # A second run in the same cache folder loads the row's executables instead of compiling.
  if jax.config.jax_enable_compilation_cache:
    again = device_check.main(['--smoke', '--models=gemma3_270m', '--formats=bf16',
                               '--engine=', '--hf=no', '--attention=no', '--threads=2',
                               f'--cache_dir={tmp_path / "compile_cache"}',
                               f'--out={tmp_path / "again"}'])
    (row,) = again['rows']
    assert row['xla_compiles'] == 0 and row['cache_hits'] >= row['executables']


def test_the_budget_bounds_the_whole_check(tmp_path):
  """--budget_s covers rows, engine rows and attention: with none left for rows, every row is
  listed as not run and the attention section gets what remains (here nothing)."""
  saved = device_check.main(['--smoke', '--formats=bf16,int8', '--engine=w8a8', '--hf=no',
                             '--threads=2', '--budget_s=0', '--attention_budget_s=5',
                             f'--out={tmp_path}'])
  assert saved['rows'] == saved['engine'] == [] and saved['not_run'] == [
      'llama32_1b bf16', 'gemma3_270m bf16', 'llama32_1b engine w8a8',
      'gemma3_270m engine w8a8', 'llama32_1b int8', 'gemma3_270m int8']
  att = saved['attention']
  assert att['prefill'] == att['decode'] == [] and len(att['not_run']) == 4
  text = (tmp_path / 'device_check.md').read_text()
  assert 'Not run (time budget): llama32_1b bf16' in text


def test_baselines_and_engine_rows_run_before_the_other_formats():
  order = device_check.row_order(['llama32_1b', 'gemma3_270m'], check_models.FORMATS, hf=True,
                                 engine=('bf16', 'w8a8'))
  models = ('llama32_1b', 'gemma3_270m')
  assert order[:4] == [(m, f) for m in models for f in ('hf-bf16', 'bf16')]
  assert order[4:8] == [(m, f'engine {f}') for m in models for f in ('bf16', 'w8a8')]
  assert order[8:16] == [(m, f) for m in models for f in ('int4', 'w8a8', 'int8', 'fp8')]
  assert order[16:] == [(m, f) for m in models for f in ('int4_pallas', 'int4_packed', 'fp8xfp8')]
  assert device_check.row_order(['gemma3_270m'], ['fp8xfp8', 'bf16'], hf=False) == [
      ('gemma3_270m', 'bf16'), ('gemma3_270m', 'fp8xfp8')]


def test_bad_names_fail_before_anything_runs(tmp_path):
  with pytest.raises(ValueError, match="model 'llama3' is unknown"):
    device_check.main(['--smoke', '--models=llama3', f'--out={tmp_path}'])
  with pytest.raises(SystemExit, match="format 'int5' is unknown"):
    device_check.main(['--smoke', '--formats=int5', f'--out={tmp_path}'])
  with pytest.raises(SystemExit, match="engine format 'int3' is unknown"):
    device_check.main(['--smoke', '--engine=int3', f'--out={tmp_path}'])


def test_chip_and_int4_group_choices():
  assert check_models.int4_group(check_models.model_config('llama32_1b', False)) == 128
  assert check_models.int4_group(check_models.model_config('gemma3_270m', False)) == 128
  assert device_env.CHIP_OF_KIND[0] == ('h200', 'h200')


def test_int4_rows_differ_only_in_layout_and_path():
  cfg = check_models.model_config('llama32_1b', True)
  pols = {f: check_models.policy(f, cfg) for f in check_models.INT4_VARIANTS}
  assert {f: p.path for f, p in pols.items()} == {'int4': 'auto', 'int4_pallas': 'pallas',
                                                   'int4_packed': 'dequant'}
  assert len({p.rules for p in pols.values()}) == 1  # the same int4 g128 weights
  assert pols['int4'].rules[0].weight.group_size == 128


def test_prediction_is_the_roofline_of_the_compilers_figures():
  """On a chip preset the predicted ms is max(bytes / HBM bandwidth, flops / peak) of XLA's
  own figures for the executable; without one, the same figures and no roofline."""
  x = jnp.ones((256, 512), jnp.float32)
  compiled = jax.jit(lambda a: jnp.tanh(a @ a.T)).lower(x).compile()
  cpu = predicted.prediction(compiled, 'matmul', None)
  assert cpu['roofline_ms'] is None and cpu['chip'] is None
  assert cpu['flops'] >= 2 * 256 * 256 * 512 and cpu['bytes_accessed'] >= x.nbytes
  h200 = predicted.prediction(compiled, 'matmul', 'h200')
  chip = costmodel.get_chip('h200')
  want = 1e3 * max(cpu['bytes_accessed'] / chip.hbm_bw, cpu['flops'] / chip.peak_flops(16))
  assert h200['roofline_ms'] == pytest.approx(want, rel=1e-9)
  assert (h200['bytes_accessed'], h200['flops']) == (cpu['bytes_accessed'], cpu['flops'])
  assert predicted.ratio(3 * want, h200) == pytest.approx(3.0)
  assert predicted.ratio(1.0, cpu) is None


def _saved_runs(tmp_path) -> str:
  """Two saved device-check results (JSON files), as --render takes them."""
  run = {'environment': {'date_utc': '2026-12-04 17:06', 'device_kind': 'NVIDIA H200',
                         'backend': 'gpu', 'versions': {'jax': '0.11.2'}, 'python': '3.12.3'},
         'protocol': {'prefill': 512, 'prompt': 128, 'steps': 64, 'batches': [1]},
         'wall_s': 10.0}
  cell = {'host_loop_ms': 3.0, 'host_loop_tok_s': 333.0, 'device_loop_ms': 1.5,
          'device_loop_tok_s': 667.0, 'hbm_fraction_device_loop': 0.35}
  a = dict(run, rows=[{'model': 'llama32_1b', 'format': 'bf16', 'weight_bytes': 2**31,
                       'prefill_tok_s': 7e4, 'b1': cell, 'compile_s': 20.0}])
  b = dict(run, rows=[{'model': 'gemma3_270m', 'format': 'int4', 'group': 128,
                       'weight_bytes': 2**28, 'prefill_tok_s': 9e4, 'b1': cell}],
           not_run=['gemma3_270m fp8'])
  paths = []
  for name, res in (('a.json', a), ('b.json', b)):
    (tmp_path / name).write_text(json.dumps(res))
    paths.append(str(tmp_path / name))
  return ','.join(paths)


@pytest.mark.plots
def test_render_merges_saved_runs(tmp_path):
  merged = device_check.main([f'--render={_saved_runs(tmp_path)}', f'--out={tmp_path}'])
  assert len(merged['rows']) == 2 and merged['wall_s'] == 20.0
  text = (tmp_path / 'device_check.md').read_text()
  assert '| bf16 | 2,048 | 70,000 | 3.000 | 1.500 | 35% | 20.0 |' in text, text
  assert '| int4 g128 |' in text and 'Not run (time budget): gemma3_270m fp8.' in text
  assert (tmp_path / 'device_check.png').read_bytes()[:4] == b'\x89PNG'


def test_render_sets_measured_beside_predicted(tmp_path):
  """A run on a chip in the cost model's table: each timed program's ms beside the compiler's
  roofline for it and their ratio; the engine rows' table beside the bare loop and HF."""
  pred = lambda ms: {'program': 'p', 'chip': 'h200', 'bytes_accessed': 2.4e9, 'flops': 4e9,
                     'temp_bytes': 2**21, 'roofline_ms': ms}
  row = {'model': 'llama32_1b', 'format': 'bf16', 'weight_bytes': 2**31, 'prefill_tok_s': 7e4,
         'prefill_tokens': 512, 'prefill_ms': 7.3, 'compile_s': 9.0,
         'b8': {'device_loop_ms': 1.5, 'device_loop_tok_s': 5333.0},
         'predicted': {'prefill': pred(3.65), 'loop_b8': pred(0.5)}}
  engine = {'model': 'llama32_1b', 'format': 'w8a8', 'kv': 'int8', 'rows': 8,
            'decode_block': 8, 'compiles_while_timed': 0,
            'engine': {'tok_s': 4000.0, 'ms_per_step': 2.0, 'host_ms_per_step': 0.3,
                       'dispatch_ms_per_step': 0.1},
            'bare_loop': {'tok_s': 5000.0, 'ms_per_step': 1.6},
            'hf': {'host_loop_tok_s': 130.0, 'host_loop_ms': 61.5},
            'predicted': {'engine_block': pred(0.4), 'loop_b8': pred(0.4)}}
  run = {'environment': {'date_utc': '2026-12-07 10:00', 'device_kind': 'NVIDIA H100',
                         'backend': 'gpu', 'versions': {'jax': '0.11.2'}, 'python': '3.12.3',
                         'compilation_cache': {'dir': '/c', 'xla_compiles': 7,
                                               'cache_hits': 2}},
         'protocol': {'prefill': 512, 'prompt': 128, 'steps': 64, 'batches': [8]},
         'wall_s': 10.0, 'rows': [row], 'engine': [engine]}
  (tmp_path / 'c.json').write_text(json.dumps(run))
  device_check.main([f'--render={tmp_path / "c.json"}', f'--out={tmp_path}'])
  text = (tmp_path / 'device_check.md').read_text()
  assert '7 executables compiled by XLA, 2 loaded from the cache' in text, text
  assert "roofline on `qjax.costmodel`'s h200" in text
  assert ('| llama32_1b bf16 | device loop b8 (decode_steps) | 1.500 | 0.5 | 3.00 | 2,289 | 4 | '
          '2 |') in text, text
  assert '| llama32_1b bf16 | prefill 512 | 7.300 | 3.65 | 2.00 |' in text
  assert ('| llama32_1b engine w8a8 (KV int8) | engine b8, decode block of 8 | 2.000 | 0.4 | '
          '5.00 |') in text
  assert '| llama32_1b | w8a8 | int8 | 4,000 | 2.000 | 0.400 | 5,000 | 130 | 0.80 | 0 |' in text


def test_render_without_matplotlib_writes_the_table(tmp_path, monkeypatch):
  """matplotlib is an optional extra: a device image without it still gets JSON + table."""
  monkeypatch.setitem(sys.modules, 'matplotlib', None)  # `import matplotlib` raises
  with pytest.warns(UserWarning, match=r"plot: figure not written: .*pip install 'qjax\[plots"):
    device_check.main([f'--render={_saved_runs(tmp_path)}', f'--out={tmp_path}'])
  assert '| int4 g128 |' in (tmp_path / 'device_check.md').read_text()
  assert not (tmp_path / 'device_check.png').exists()


def test_decode_dispatch_runs():
  from benchmarks import decode_dispatch  # pylint: disable=g-import-not-at-top
  out = decode_dispatch.main(['--layers=1', '--steps=3', '--reps=1'])
  assert out['host'] > 0 and out['device'] > 0


def test_an_engine_rows_hf_cell_reuses_the_hf_row_else_is_timed_or_says_why(monkeypatch):
  """HF eager at the engine's 8 rows: the HF row's own cell where it timed batch 8, timed now
  where it did not, and the reason where HF cannot run (no torch on this image)."""
  p = check_models.Protocol(prefill=32, prompt=16, steps=4, batches=(1, 8), reps=1)
  cell = {'host_loop_ms': 50.0, 'host_loop_tok_s': 160.0}
  result = {'rows': [{'model': 'llama32_1b', 'format': 'hf-bf16', 'b8': cell}]}
  assert device_check._hf_at(result, 'llama32_1b', 8, None, p, True) == dict(
      cell, source='the HF row')
  timed = []
  monkeypatch.setattr(device_check.hf_rows, 'decode_cell',
                      lambda m, b, p, smoke: timed.append((m, b)) or dict(cell))
  assert device_check._hf_at(result, 'gemma3_270m', 8, None, p, True) == dict(
      cell, source='timed here')
  assert timed == [('gemma3_270m', 8)]
  assert device_check._hf_at({'rows': []}, 'llama32_1b', 8, 'torch is not installed', p,
                             True) == {'skipped': 'HF: torch is not installed'}
