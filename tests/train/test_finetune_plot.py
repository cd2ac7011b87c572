"""qjax.pipeline.finetune_plot: the sweep's plot draws each point's perplexities (the
quantized base only beside an adapted point) and the training cost of the trained points."""

import pytest

from qjax.pipeline import finetune_plot

ROWS = [
    {'name': 'float', 'kind': 'float', 'ppl': 30.67, 'status': 'ok'},
    {'name': 'base-rtn-int4-g128', 'kind': 'base', 'ppl': 63.19, 'status': 'ok'},
    {'name': 'qlora-r4-rtn-int4-g128', 'kind': 'qlora', 'ppl': 32.8, 'base_ppl': 63.19,
     'merged_ppl': 61.05, 'trainable_params': 949248, 'train_peak_rss_mib': 4657.0,
     'status': 'ok'},
    {'name': 'full-bfloat16', 'kind': 'full', 'ppl': 33.36, 'base_ppl': None,
     'trainable_params': 268098176, 'train_peak_rss_mib': 7323.0, 'status': 'ok'},
    {'name': 'qlora-r16-gptq-int4-g128', 'kind': 'qlora', 'status': 'failed'},
]


@pytest.mark.plots
def test_plot_draws_each_finished_points_perplexities_and_training_cost(tmp_path):
  path = tmp_path / 'sub' / 'plot.png'
  values = finetune_plot.plot_finetune(ROWS, str(path), 'title')
  assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  point, merged, base = ('point (adapted / trained / as is)', 'merged + re-quantized',
                         'quantized base')
  assert values['ppl'] == {
      'float': {point: 30.67}, 'base-rtn-int4-g128': {point: 63.19},
      'qlora-r4-rtn-int4-g128': {base: 63.19, point: 32.8, merged: 61.05},
      'full-bfloat16': {point: 33.36}}
  assert values['memory'] == {'qlora-r4-rtn-int4-g128': (949248, 4657.0),
                              'full-bfloat16': (268098176, 7323.0)}
