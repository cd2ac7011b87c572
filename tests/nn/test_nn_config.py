"""TransformerConfig: validation, layer kinds, presets (Gemma 3 270M expressed exactly)."""

import pytest
from flax import nnx

from qjax.nn import Transformer, TransformerConfig, num_params, param_count


@pytest.mark.parametrize('overrides, match', [
    (dict(num_heads=4, num_kv_heads=3), 'num_heads=4 is not a multiple of num_kv_heads=3'),
    (dict(head_dim=31), 'head_dim=31 must be even'),
    (dict(mlp='relu'), "mlp='relu' is unknown"),
    (dict(d_model=0), 'd_model=0 must be a positive integer'),
    (dict(global_every=2), 'global_every=2 needs sliding_window'),
    (dict(sliding_window=0), 'sliding_window=0'),
    (dict(dtype='int8'), "dtype='int8' is not a float dtype"),
    (dict(final_logit_softcap=-1.0), 'final_logit_softcap=-1.0'),
])
def test_bad_configs_raise_naming_the_value(overrides, match):
  with pytest.raises(ValueError, match=match):
    TransformerConfig.tiny(**overrides)


def test_layer_kinds_and_rope_bases():
  cfg = TransformerConfig.gemma3_270m()
  kinds = ['G' if not cfg.is_local(i) else 'L' for i in range(cfg.num_layers)]
  assert ''.join(kinds) == 'LLLLLG' * 3  # layers 5, 11, 17 global
  assert cfg.window(0) == 512 and cfg.window(5) is None
  assert cfg.rope_base_for(0) == 1e4 and cfg.rope_base_for(5) == 1e6
  assert not TransformerConfig.tiny().is_local(0)
  mistral = TransformerConfig.tiny(sliding_window=8)  # window without global_every: all local
  assert all(mistral.is_local(i) for i in range(mistral.num_layers))


def test_gemma3_270m_parameter_count_abstractly():
  cfg = TransformerConfig.gemma3_270m()
  assert num_params(cfg) == 268_098_176
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  assert param_count(abstract) == 268_098_176


@pytest.mark.parametrize('cfg', [TransformerConfig.tiny(), TransformerConfig.tiny(
    tie_embeddings=False, qk_norm=True, post_norms=True)])
def test_num_params_matches_model(cfg):
  assert param_count(Transformer(cfg, rngs=nnx.Rngs(0))) == num_params(cfg)


def test_every_param_has_logical_axes():
  model = Transformer(TransformerConfig.tiny(qk_norm=True, post_norms=True,
                                             tie_embeddings=False), rngs=nnx.Rngs(0))
  for path, var in nnx.iter_graph(model):
    if isinstance(var, nnx.Param):
      axes = var.get_metadata().get('out_sharding')
      assert axes is not None and len(axes) == var.get_value().ndim, path
