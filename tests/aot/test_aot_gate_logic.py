"""qjax.aot.gate without a toolchain: the plan it compiles, its checks, its bytes record."""

import dataclasses

import pytest

from qjax.aot import gate, programs


def _record(compiled=True, error=None, expect_error=None, kernels=(), names=None, calls=None,
            temp=0, kind='decode_b1', fmt='int8', target='v5e-1', bytes_=100.0):
  job = gate.Job(kind, target, 'llama', fmt, kernels=kernels, error=expect_error, why='test')
  families = ['qjax_cpu_kernel'] if calls and 'qjax_gemv' in ''.join(calls) else []
  report = {'compiled': compiled, 'error': error, 'kernel_names': names or {},
            'custom_calls': calls or {}, 'kernels': families, 'temp_bytes': temp,
            'bytes_accessed': bytes_, 'bytes_source': 'xla cost analysis'}
  return {'job': dataclasses.asdict(job), 'program': kind, 'held': {}, 'report': report}


def test_a_clean_record_has_no_problem():
  assert gate.check(_record(kernels=('splash',), names={'splash_mqa_fwd': 1}, temp=10), 10) == []


@pytest.mark.parametrize('record, budget, category, words', [
    (_record(compiled=False, error='MosaicError: no'), None, 'compile', 'did not compile'),
    (_record(expect_error='infer-vector-layout'), None, 'compile', 'expected to refuse'),
    (_record(compiled=False, error='ValueError: other', expect_error='infer-vector-layout'),
     None, 'compile', 'another message'),
    (_record(kernels=('qjax_paged_attention_mosaic',), names={'_qmm': 2}), None, 'kernel',
     "kernels called: ['_qmm']"),
    (_record(calls={'qjax_gemv_kn_int8': 1}), None, 'cpu_kernel', 'path decision'),
    (_record(temp=101), 100, 'temp', 'temp 101 bytes over its budget 100'),
])
def test_each_problem_is_reported_with_what_went_wrong(record, budget, category, words):
  [(cat, message)] = gate.check(record, budget)
  assert cat == category and words in message and 'v5e-1 decode_b1 (llama, int8)' in message


def test_an_expected_refusal_with_its_message_is_no_problem():
  record = _record(compiled=False, error='Mosaic: infer-vector-layout: unsupported',
                   expect_error='infer-vector-layout')
  assert gate.check(record) == []


def test_the_ci_plan_is_a_subset_of_the_full_one_and_covers_every_axis():
  full = set(gate.jobs('full'))
  ci = gate.jobs('ci')
  assert set(ci) < full and len(ci) == len(set(ci))
  assert len([j for j in full if j.kind != 'kernel' and j.variant != 'mixed']) == (
      len(gate.TARGETS) * len(gate.models()) * len(gate.KINDS) * len(programs.FORMATS))
  for target in gate.TARGETS:
    mine = [j for j in ci if j.target == target]
    assert {j.kind for j in mine} == set(gate.KINDS) | {'kernel'}
    assert {j.fmt for j in mine if j.fmt} == set(programs.FORMATS)
    assert {j.model for j in mine if j.model} == set(gate.models())
  with pytest.raises(ValueError, match="scope 'nightly' is unknown"):
    gate.jobs('nightly')


def test_the_tpu_expects_splash_the_paged_and_ragged_kernels_and_a_g64_refusal():
  jobs = gate.jobs('ci', ('v5e-1',))
  assert all(j.kernels == ('splash',) for j in jobs if j.kind == 'prefill')
  assert all(j.kernels == ('qjax_paged_attention_mosaic',) for j in jobs
             if j.kind.startswith('engine') and j.variant != 'mixed')
  mixed = [j for j in jobs if j.variant == 'mixed']
  assert mixed and all(j.kernels == ('qjax_ragged_paged_attention_mosaic',) for j in mixed)
  refused = {j.variant: j.error for j in jobs if j.error}
  assert refused == {'mosaic_rejected': 'infer-vector-layout',
                     'qmm int8 g64': 'divisible by 8 and 128',
                     'qmm int4 g64': 'divisible by 8 and 128'}


def test_bytes_are_recorded_against_bf16_at_the_same_shapes():
  records = [_record(fmt='bf16', bytes_=200.0), _record(fmt='int4', bytes_=50.0),
             _record(fmt='int8', kind='decode_b8', bytes_=80.0),  # no bf16 decode_b8
             _record(fmt='int8', compiled=False, error='x')]
  [row] = gate.bytes_vs_bf16(records)
  assert (row['format'], row['program'], row['ratio']) == ('int4', 'decode_b1', 0.25)
  table = gate.bytes_markdown([row])
  assert '| int4 | 0.25 |' in table and 'llama decode_b1 v5e-1' in table
  # the HBM traffic counted from the HLO (the roofline's bytes) wins over XLA's bytes accessed
  traffic = [_record(fmt='bf16', bytes_=500.0), _record(fmt='int8', bytes_=400.0)]
  traffic[0]['report']['hbm_traffic'], traffic[1]['report']['hbm_traffic'] = 200, 100
  [row] = gate.bytes_vs_bf16(traffic)
  assert row['ratio'] == 0.5 and row['source'] == 'hbm traffic from the compiled HLO'
  assert 'v5e-1: xla cost analysis' in table
  assert 'No format compiled' in gate.bytes_markdown([])
