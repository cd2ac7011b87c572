"""Sweep overrides: top-level keys, dotted keys, and clear errors for keys that name no field,
descend into a value, or replace a whole section."""

import ml_collections
import pytest

from qjax.pipeline import apply_overrides


def _config():
  return ml_collections.ConfigDict({'seed': 0, 'out_dir': 'x', 'quant': {'bits': 4}})


def test_top_level_and_dotted_keys_are_applied_to_a_copy():
  c = _config()
  out = apply_overrides(c, {'seed': 3, 'quant.bits': 8})
  assert (out.seed, out.quant.bits) == (3, 8)
  assert (c.seed, c.quant.bits) == (0, 4)


@pytest.mark.parametrize('key, message', [
    ('nope', r"'nope': no config field 'nope' in the config; fields there are \['out_dir', "
             r"'quant', 'seed'\]"),
    ('quant.bitz', r"no config field 'bitz' in quant; fields there are \['bits'\]"),
    ('seed.x', r"'seed' is a value \(0\), not a section"),
    ('quant', r"'quant' is a section .*override its fields, e.g. 'quant.bits'"),
    ('quant..bits', 'keys are config field names'),
])
def test_bad_keys_are_clear_errors(key, message):
  with pytest.raises(ValueError, match=message):
    apply_overrides(_config(), {key: 1})
