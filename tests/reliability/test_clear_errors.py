"""Each input that used to fail with a cryptic error (AttributeError, bare KeyError, an XLA
message) now gets a ValueError naming the value and the fix."""

import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax import checkpoints as qckpt
from qjax.core import fake_quant, int_format, qdot, quantize
from qjax.infer import Engine, EngineConfig, SamplingParams
from qjax.nn import (QuantPolicy, QuantRule, Transformer, TransformerConfig, greedy_generate)

CFG = TransformerConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=16, d_ff=64, max_len=32)
HF_TINY = pathlib.Path(__file__).resolve().parents[1] / 'testdata' / 'hf_tiny' / 'llama'


@pytest.fixture(scope='module')
def model():
  return Transformer(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope='module')
def engine(model):
  return Engine(model, EngineConfig(max_batch=2, page_size=4, num_pages=16, chunk_size=8))


# ---- quantization policy -------------------------------------------------------------------
@pytest.mark.parametrize('make,message', [
    (lambda: QuantRule('.*', 'int4'),
     r"QuantRule\('\.\*'\): weight='int4' is a str, not a QFormat; pass weight=int_format\(4\)"),
    (lambda: QuantRule('.*', 'int4_g128'), r'pass weight=int_format\(4, group_size=128\)'),
    (lambda: QuantRule(None, int_format(8)),
     r'QuantRule: pattern=None must be a regex string over module paths'),
    (lambda: QuantPolicy(['.*', 'embed']),
     r"QuantPolicy: rules\[0\]='\.\*' is a str, not a QuantRule; write "
     r"QuantRule\('\.\*', int_format\(8\)\)"),
    (lambda: QuantPolicy(QuantRule('.*', int_format(8))),
     r'rules is one QuantRule; pass a tuple of them'),
])
def test_policy_mistakes(make, message):
  with pytest.raises(ValueError, match=message):
    make()


# ---- quantizers ----------------------------------------------------------------------------
@pytest.mark.parametrize('scale', [0.0, -0.5, float('nan'), float('inf')])
def test_fake_quant_refuses_a_bad_given_scale(scale):
  # A zero scale used to return all zeros, a negative one flipped the signs.
  x = jnp.linspace(-1, 1, 16).reshape(4, 4)
  with pytest.raises(ValueError, match=r'given scale\(s\) are not finite and > 0 \(the one at '
                                       r'index \(0, 0\) is'):
    fake_quant(x, int_format(8), scale=jnp.full((1, 1), scale))


def test_float32_subnormal_groups_are_refused_like_float16_underflow():
  w = np.random.RandomState(0).randn(8, 16).astype(np.float32)
  w[:, :8] *= np.float32(1e-39)  # subnormal: flushed to zero by XLA, so it quantized to 0
  fmt = int_format(8, group_size=8, group_axis=1, channel_axes=(0,))
  with pytest.raises(ValueError, match=r'8 scale group\(s\) hold only float32 subnormal values '
                                       r'\(the one at scale index \(0, 0\)'):
    quantize(w, fmt)
  with pytest.raises(ValueError, match='hold only float32 subnormal values'):
    fake_quant(jnp.asarray(w), fmt)
  w[:, :8] = 0  # exact zeros are fine: they quantize to exact zeros
  assert np.asarray(quantize(w, fmt).dequantize())[:, :8].max() == 0


def test_quantize_a_python_list():
  with pytest.raises(ValueError, match=r'got a Python list, not an array; pass '
                                       r'jnp.asarray\(x, jnp.float32\)'):
    quantize([0.1, -0.2, 0.3], int_format(8))


def test_group_size_past_the_limit_states_it():
  with pytest.raises(ValueError, match=r'group_size=1000000 must be in \[1, 65536\]'):
    int_format(4, group_size=10**6)


@pytest.mark.parametrize('quantized', [False, True])
def test_qdot_with_mismatched_k(quantized):
  w = jax.random.normal(jax.random.key(0), (16, 4))
  w = quantize(w, int_format(8, channel_axes=(1,))) if quantized else w
  with pytest.raises(ValueError, match=r"qdot: x\(2, 8\) @ w\(16, 4\): w must be 2-d \(K, N\) "
                                       r"with K equal to x's last axis"):
    qdot(jnp.ones((2, 8)), w)


# ---- generation and the engine --------------------------------------------------------------
@pytest.mark.parametrize('num_steps', [2.5, 2.0, True, '3'])
def test_greedy_generate_num_steps_must_be_an_int(model, num_steps):
  with pytest.raises(ValueError, match=rf'greedy_generate: num_steps={num_steps!r} must be an '
                                       r'int >= 0'):
    greedy_generate(model, [[1, 2]], num_steps)


@pytest.mark.parametrize('prompt,message', [
    ([1, None, 3], r'request \w+: token id None is not an integer'),
    ([[1, 2], [3, 4]], r'token ids of shape \(2, 2\); expected shape \(T,\), one prompt; pass '
                       r'one prompt'),
    ([1.0, 2.0], r'token ids must be integers, got dtype float64'),
    ([1, '3'], r"request \w+: token id '3' is not an integer"),  # was '1', numpy's str of 1
    ([True, 2], r'request \w+: token id True is a bool, not an integer'),  # was accepted
])
def test_add_request_prompts(engine, prompt, message):
  with pytest.raises(ValueError, match=message):
    engine.add_request(prompt)
  assert not engine.scheduler.has_work


def test_params_of_the_wrong_type(engine):
  with pytest.raises(ValueError, match=r"params=\{'temperature': 0\} is a dict, not a "
                                       r'SamplingParams; pass SamplingParams\(\.\.\.\)'):
    engine.add_request([1, 2], {'temperature': 0})


def test_generate_needs_a_list_of_prompts(engine):
  with pytest.raises(ValueError, match=r'prompts must be a list of prompts.*pass \[prompt\]'):
    engine.generate([1, 2, 3])


def test_unknown_request_id(engine):
  rid = engine.add_request([1, 2], SamplingParams(temperature=0, max_tokens=1))
  for _ in engine.run():
    pass
  for method in (engine.output, engine.finish_reason, engine.logprobs,
                 engine.prefix_hit_tokens):
    with pytest.raises(KeyError, match=r"Engine: no request with id 'nope'; the ids are those "
                                       rf"add_request returned \(\d+ known: .*'{rid}'"):
      method('nope')


@pytest.mark.parametrize('max_len', [0, -4, 2.5])
def test_engine_config_max_len(max_len):
  with pytest.raises(ValueError, match=rf'EngineConfig: max_len={max_len!r} must be a positive '
                                       r'integer'):
    EngineConfig(max_len=max_len)


# ---- checkpoints ---------------------------------------------------------------------------
def test_safetensors_config_missing_a_key(tmp_path):
  d = tmp_path / 'hf'
  shutil.copytree(HF_TINY, d)
  config = json.loads((d / 'config.json').read_text())
  del config['intermediate_size']
  (d / 'config.json').write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"config.json: missing \['intermediate_size'\] "
                                       r"\(model_type 'llama' needs"):
    qckpt.load_hf(d)


def test_dangling_safetensors_symlink(tmp_path):
  d = tmp_path / 'hf'
  shutil.copytree(HF_TINY, d)
  (d / 'model.safetensors').unlink()
  os.symlink(tmp_path / 'blobs' / 'gone', d / 'model.safetensors')
  with pytest.raises(ValueError, match=r'model.safetensors: a symlink to .*gone.*which does not '
                                       r'exist \(a dangling link'):
    qckpt.load_hf(d)


def test_dangling_symlink_inside_a_checkpoint(tmp_path):
  from qjax.nn import quantize_model  # pylint: disable=g-import-not-at-top
  qmodel, _ = quantize_model(Transformer(CFG, rngs=nnx.Rngs(0)),
                             QuantPolicy((QuantRule('.*', int_format(8)),)))
  fields = {f: 'none' for f in qckpt.REQUIRED_FIELDS
            if f not in ('runtime', 'hardware', 'artifacts')}
  out = tmp_path / 'q'
  qckpt.save_quantized(str(out), qmodel, QuantPolicy((QuantRule('.*', int_format(8)),)), fields)
  meta = out / 'state' / '_METADATA'
  meta.unlink()
  os.symlink('_METADATA.moved', meta)  # inside the directory, but its target is gone
  with pytest.raises(ValueError, match=r"_METADATA' is a symlink to '_METADATA.moved', which "
                                       r'does not exist \(a dangling link'):
    qckpt.load_quantized(str(out))


def test_load_gguf_of_a_directory(tmp_path):
  (tmp_path / 'model.gguf').write_bytes(b'')
  with pytest.raises(ValueError, match=r"GGUF: '.*' is a directory; pass the .gguf file itself, "
                                       r"e.g. '.*model.gguf'"):
    qckpt.load_gguf(tmp_path)


# ---- kernels and layouts --------------------------------------------------------------------
@pytest.mark.parametrize('x,w,scale,message', [
    ((0, 8), (8, 4), (1, 4), r'an empty operand \(M=0, D=8, F=4'),
    ((1, 0), (0, 4), (1, 4), r'an empty operand \(M=1, D=0, F=4'),
    ((1, 8), (8, 0), (1, 0), r'an empty operand \(M=1, D=8, F=0'),
    ((1, 8), (8, 4), (0, 4), r'scales \(0, 4\) must be \(Q, F=4\) with Q >= 1 dividing D=8'),
])
def test_pallas_qmm_with_an_empty_dimension(x, w, scale, message):
  # Were a ZeroDivisionError (D or Q of 0) or a TypeError from the grid (M or F of 0).
  from qjax.kernels import pallas_qmm  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=f'pallas_qmm: {message}'):
    pallas_qmm.qmm(jnp.zeros(x), jnp.zeros(w, jnp.int8), jnp.ones(scale), bits=8)


def test_to_layout_of_a_float_array():
  from qjax.core.layouts import to_layout  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=r'to_layout: got ArrayImpl of shape \(2, 3\), not a '
                                       r'QArray; .*quantize first'):
    to_layout(jnp.zeros((2, 3)), 'native')
