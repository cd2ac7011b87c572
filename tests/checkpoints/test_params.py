"""Flat parameter dicts <-> Transformer: the checks every importer relies on."""

import numpy as np
import pytest

from qjax.checkpoints.params import model_from_params, model_params, param_shapes
from qjax.nn import TransformerConfig, num_params, param_count


@pytest.fixture(scope='module')
def cfg():
  return TransformerConfig.tiny(qkv_bias=True, qk_norm=True, tie_embeddings=False)


def test_round_trip_and_bias_params(cfg):
  rng = np.random.default_rng(0)
  params = {k: rng.standard_normal(s).astype(np.float32) for k, s in param_shapes(cfg).items()}
  assert param_shapes(cfg)['layers/0/attn/q_bias'] == (cfg.num_heads, cfg.head_dim)
  model = model_from_params(cfg, params)
  back = model_params(model)
  assert set(back) == set(params)
  assert all(np.array_equal(back[k], params[k]) for k in params)
  assert param_count(model) == num_params(cfg)


def test_missing_extra_and_misshapen_params_are_clear_errors(cfg):
  params = {k: np.zeros(s, np.float32) for k, s in param_shapes(cfg).items()}
  with pytest.raises(ValueError, match=r"missing \['embed/w'\]"):
    model_from_params(cfg, {k: v for k, v in params.items() if k != 'embed/w'}, source='x')
  with pytest.raises(ValueError, match=r"unexpected \['bogus'\]"):
    model_from_params(cfg, dict(params, bogus=np.zeros(1)), source='x')
  with pytest.raises(ValueError, match=r"'final_norm/scale' has shape \(3,\), the model config "
                                       r'implies \(64,\)'):
    model_from_params(cfg, dict(params, **{'final_norm/scale': np.zeros(3)}), source='x')
