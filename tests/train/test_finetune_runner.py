"""The fine-tuning entry points' shared body: `only=` point selection (a ':variant' suffix of
the config path dropped), unknown names and model sources refused with clear errors."""

import ml_collections
import pytest

from qjax.pipeline import finetune_runner

_CONFIG_FILE = '''
def sweep():
  return [{'point.kind': 'float'}, {'point.kind': 'qat', 'qat.kv': 'int4'}, {'point.kind': 'qat'}]
'''


def _config(only=''):
  return ml_collections.ConfigDict({'only': only, 'model_source': 'tiny', 'point': {'kind': ''},
                                    'qat': {'kv': ''}})


def _name(c):
  return c.point.kind + (f'-kv{c.qat.kv}' if c.qat.kv else '')


def test_only_selects_points_in_sweep_order_and_the_variant_suffix_is_dropped(tmp_path):
  path = tmp_path / 'cfg.py'
  path.write_text(_CONFIG_FILE)
  everything = finetune_runner.selected_points(_config(), f'{path}:tiny', _name)
  assert everything == [{'point.kind': 'float'}, {'point.kind': 'qat', 'qat.kv': 'int4'},
                        {'point.kind': 'qat'}]
  picked = finetune_runner.selected_points(_config('qat,float'), f'{path}:tiny', _name)
  assert picked == [{'point.kind': 'float'}, {'point.kind': 'qat'}]


def test_unknown_point_name_and_model_source_are_clear_errors(tmp_path):
  path = tmp_path / 'cfg.py'
  path.write_text(_CONFIG_FILE)
  with pytest.raises(ValueError, match=r"only='flaot': no point named \['flaot'\]; the sweep "
                                       r"has \['float', 'qat-kvint4', 'qat'\]"):
    finetune_runner.selected_points(_config('flaot'), str(path), _name)
  c = _config()
  c.model_source = 'gemma4'
  with pytest.raises(ValueError, match=r"model_source='gemma4' is unknown; use one of "
                                       r"\['gemma3_270m', 'tiny'\]"):
    finetune_runner.make_context(c)
