"""HF config.json mapping and refusals, and the loader's file handling, without torch.

Hand-written config dicts and tiny safetensors files written with numpy: what each family's
keys become in `TransformerConfig`, what is refused (with the value named) before any weight
is read, sharded / bf16 / multimodal-prefixed files. The logits against HF transformers
itself are `test_hf_families.py` (the reference extra).
"""

import dataclasses
import json
import math

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip('safetensors')

from qjax.checkpoints import hf_config, load_hf, model_params  # noqa: E402
from qjax.nn import TransformerConfig  # noqa: E402
from qjax.nn.rope import RopeScaling, inv_frequencies  # noqa: E402
import hf_testdata  # noqa: E402

BASE = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            num_hidden_layers=2, vocab_size=40, intermediate_size=48, rms_norm_eps=1e-5,
            max_position_embeddings=64)


def _llama(**kw):
  return {**BASE, 'model_type': 'llama', 'hidden_act': 'silu', **kw}


def _gemma3(**kw):
  return dict(BASE, model_type='gemma3_text', hidden_activation='gelu_pytorch_tanh', **kw)


def test_gemma2_maps_softcaps_windows_query_scale_and_norms():
  cfg = hf_config(dict(BASE, model_type='gemma2', hidden_activation='gelu_pytorch_tanh',
                       num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=32,
                       final_logit_softcapping=30.0, attn_logit_softcapping=50.0))
  assert (cfg.mlp, cfg.norm_plus_one, cfg.post_norms, cfg.embed_scale) == ('geglu', True, True,
                                                                            True)
  assert cfg.sliding_window == 8 and cfg.global_every == 2  # layers 1 and 3 global
  assert [cfg.is_local(i) for i in range(4)] == [True, False, True, False]
  assert cfg.query_scale == pytest.approx(32 ** -0.5) and not cfg.qk_norm
  assert (cfg.final_logit_softcap, cfg.attn_logit_softcap) == (30.0, 50.0)
  assert cfg.tie_embeddings


def test_gemma3_multimodal_config_is_its_text_tower_with_old_style_rope_keys():
  text = _gemma3(num_hidden_layers=6, sliding_window=16, rope_theta=1e6,
                 rope_local_base_freq=1e4, rope_scaling={'rope_type': 'linear', 'factor': 8.0})
  text.pop('model_type')
  cfg = hf_config({'model_type': 'gemma3', 'text_config': text, 'tie_word_embeddings': True})
  assert cfg.qk_norm and cfg.global_every == 6 and cfg.sliding_window == 16
  assert cfg.rope_for(0) == (1e4, None)  # sliding layers: plain RoPE at the local base
  assert cfg.rope_for(5) == (1e6, RopeScaling('linear', 8.0))  # global: scaled


def test_llama3_yarn_and_dynamic_rope():
  cfg = hf_config(_llama(rope_parameters=dict(
      rope_type='llama3', rope_theta=5e5, factor=8.0, low_freq_factor=1.0,
      high_freq_factor=4.0, original_max_position_embeddings=8192)))
  assert cfg.rope_base == 5e5 and cfg.rope_scaling.original_max_len == 8192
  yarn = hf_config(_llama(model_type='qwen2', rope_theta=1e6,
                          rope_scaling={'type': 'yarn', 'factor': 4.0,
                                        'original_max_position_embeddings': 32}))
  assert yarn.rope_scaling.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
  dynamic = hf_config(_llama(rope_parameters=dict(rope_type='dynamic', factor=2.0)))
  assert dynamic.rope_scaling is None and dynamic.max_len == 64


def test_rope_scaling_frequencies():
  plain = inv_frequencies(64, 5e5)
  np.testing.assert_allclose(inv_frequencies(64, 5e5, RopeScaling('linear', 4.0)), plain / 4)
  scaled = inv_frequencies(64, 5e5, RopeScaling('llama3', 8.0, original_max_len=8192))
  wavelen = 2 * np.pi / plain
  np.testing.assert_array_equal(scaled[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])
  np.testing.assert_allclose(scaled[wavelen > 8192], plain[wavelen > 8192] / 8, rtol=1e-6)
  mid = (wavelen >= 8192 / 4) & (wavelen <= 8192)
  assert mid.any() and np.all(scaled[mid] < plain[mid]) and np.all(scaled[mid] > plain[mid] / 8)
  plain = inv_frequencies(64, 1e4)  # yarn: fast dimensions kept, slow ones interpolated
  yarn = inv_frequencies(64, 1e4, RopeScaling('yarn', 4.0, original_max_len=32))
  assert yarn[0] == pytest.approx(plain[0]) and yarn[-1] == pytest.approx(plain[-1] / 4)


def test_config_with_rope_scaling_survives_a_json_round_trip():
  cfg = TransformerConfig.tiny(rope_scaling=RopeScaling('llama3', 8.0, original_max_len=16))
  again = TransformerConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
  assert again == cfg and hash(again) == hash(cfg)


@pytest.mark.parametrize('changes, match', [
    (dict(rope_parameters={'rope_type': 'longrope', 'rope_theta': 1e4}),
     r"rope_type 'longrope' is not supported; qjax supports \('default', 'linear'"),
    (dict(model_type='mixtral'), r"model_type 'mixtral' \(a mixture-of-experts model\)"),
    (dict(model_type='qwen3_moe'), r"model_type 'qwen3_moe' \(a mixture-of-experts"),
    (dict(num_experts=8), 'num_experts=8: a mixture-of-experts model'),
    (dict(quantization_config={'quant_method': 'gptq'}), 'already quantized by another tool'),
    (dict(rope_parameters={'rope_type': 'default', 'mrope_section': [8, 8]}),
     r"rope parameters \['mrope_section'\]"),
    (dict(partial_rotary_factor=0.5), 'partial_rotary_factor=0.5'),
    (dict(num_hidden_layers=3, sliding_window=8,
          layer_types=['full_attention', 'sliding_attention', 'sliding_attention']),
     'mix sliding and full attention'),
    (dict(hidden_act='gelu'), "hidden_act 'gelu'"),
])
def test_unsupported_options_are_refused_by_name(changes, match):
  hf_config(_llama(partial_rotary_factor=None, rope_parameters={'rope_type': 'default',
                                                                'partial_rotary_factor': 1.0}))
  with pytest.raises(ValueError, match=match):
    hf_config(_llama(**changes))


def test_gemma3_sliding_layers_with_scaled_rope_are_refused():
  with pytest.raises(ValueError, match="sliding layers' rope_type 'linear'"):
    hf_config(_gemma3(rope_parameters={
        'full_attention': {'rope_type': 'default', 'rope_theta': 1e6},
        'sliding_attention': {'rope_type': 'linear', 'factor': 2.0, 'rope_theta': 1e4}}))


def _random_params(cfg):
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from qjax.nn import Transformer  # pylint: disable=g-import-not-at-top
  return model_params(Transformer(cfg, rngs=nnx.Rngs(0)))


def test_sharded_bf16_checkpoint_loads_through_its_index(tmp_path):
  hf_cfg = _llama(tie_word_embeddings=False)
  params = _random_params(hf_config(hf_cfg))
  hf_testdata.write_hf(tmp_path / 'ckpt', hf_cfg, params, dtype=ml_dtypes.bfloat16, shards=3)
  (tmp_path / 'ckpt' / 'stray.safetensors').write_bytes(b'not read: the index lists the shards')
  model, info = load_hf(tmp_path / 'ckpt')
  assert len(info['files']) == 3 and info['source_dtypes'] == ['bfloat16']
  got = model_params(model)
  for key, want in params.items():
    np.testing.assert_array_equal(got[key], want.astype(ml_dtypes.bfloat16).astype(np.float32))
  (tmp_path / 'ckpt' / 'model-00002-of-00003.safetensors').unlink()
  with pytest.raises(ValueError, match=r"shards \['model-00002-of-00003.safetensors'\]"):
    load_hf(tmp_path / 'ckpt')


def test_multimodal_gemma3_text_tower_is_read_and_the_vision_tower_skipped(tmp_path):
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  text = _gemma3(num_hidden_layers=2, sliding_window=8)
  params = _random_params(hf_config(text))
  hf_testdata.write_hf(tmp_path / 'g3', {'model_type': 'gemma3', 'text_config': text}, params,
            prefix='language_model.model.')
  path = tmp_path / 'g3' / 'model.safetensors'
  save_file(dict(load_file(path), **{'vision_tower.patch_embedding.weight':
                                     np.ones((4, 3), np.float32)}), str(path))
  model, info = load_hf(tmp_path / 'g3')
  assert info['model_type'] == 'gemma3_text'
  np.testing.assert_array_equal(model_params(model)['layers/1/attn/q_norm/scale'],
                                params['layers/1/attn/q_norm/scale'])


def test_refusal_comes_before_any_weight_is_read(tmp_path):
  (tmp_path / 'config.json').write_text(json.dumps(_llama(
      rope_parameters={'rope_type': 'longrope', 'rope_theta': 1e4})))
  (tmp_path / 'model.safetensors').write_bytes(b'\x00' * 16)  # unreadable: never opened
  with pytest.raises(ValueError, match="rope_type 'longrope'"):
    load_hf(tmp_path)


def test_dynamic_rope_refuses_a_context_past_max_position_embeddings(tmp_path):
  hf_cfg = _llama(rope_parameters=dict(rope_type='dynamic', factor=2.0))
  hf_testdata.write_hf(tmp_path, hf_cfg, _random_params(hf_config(hf_cfg)))
  assert load_hf(tmp_path, max_len=32)[0].config.max_len == 32
  with pytest.raises(ValueError, match=r"max_len=128: .*'dynamic'.* pass max_len <= 64"):
    load_hf(tmp_path, max_len=128)


def test_multimodal_gemma3_text_keys_absent_from_config_json_take_the_defaults():
  # What google/gemma-3-4b-it's config.json writes under text_config.
  text = dict(hidden_size=2560, intermediate_size=10240, model_type='gemma3_text',
              num_hidden_layers=34, rope_scaling={'factor': 8.0, 'rope_type': 'linear'},
              sliding_window=1024)
  cfg = hf_config({'model_type': 'gemma3', 'text_config': text})
  assert (cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (262_208, 8, 4, 256)
  assert cfg.global_every == 6 and cfg.sliding_window == 1024 and cfg.max_len == 131_072
  assert cfg.rope_for(5) == (1e6, RopeScaling('linear', 8.0)) and cfg.rope_for(0) == (1e4, None)
  assert cfg.query_scale == 256 ** -0.5 and cfg.tie_embeddings


def test_scaled_rope_keeps_relative_positions_and_applies_the_attention_factor():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from qjax.nn import apply_rope  # pylint: disable=g-import-not-at-top
  yarn = RopeScaling('yarn', 4.0, original_max_len=32, attention_factor=1.25)
  rng = np.random.default_rng(0)
  q, k = (jnp.asarray(rng.standard_normal((1, 1, 1, 16)), jnp.float32) for _ in range(2))
  rot = lambda x, p, s=yarn: apply_rope(x, jnp.full((1, 1), p), 1e4, s)[0, 0, 0]
  dot = lambda m, n: float(jnp.dot(rot(q, m), rot(k, n)))
  assert dot(50, 7) == pytest.approx(dot(143, 100), rel=1e-4)  # depends on m - n only
  assert float(jnp.linalg.norm(rot(q, 9))) == pytest.approx(
      1.25 * float(jnp.linalg.norm(q)), rel=1e-5)
  linear = RopeScaling('linear', 4.0)  # position interpolation: position p acts as p / 4
  np.testing.assert_allclose(rot(q, 40, linear), rot(q, 10, None), rtol=1e-5, atol=1e-6)
