"""Checkpoints hold packed codes: a model running native codes (the GPU/TPU default) saves
and reloads, on any backend, to the layout that backend runs."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax.checkpoints import REQUIRED_FIELDS, load_quantized, save_quantized
from qjax.core import int_format, layouts
from qjax.nn import QuantPolicy, QuantRule, Transformer, TransformerConfig, einsum_layers
from qjax.nn import quantize_model

CFG = TransformerConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=16, d_ff=64, max_len=16)
TOKENS = jax.random.randint(jax.random.key(1), (2, 8), 0, CFG.vocab_size)


def _dtypes(m):
  return {l.w.get_value().data.dtype for _, l in einsum_layers(m) if l.quantized}


def test_native_model_saves_packed_and_reloads_in_the_default_layout(tmp_path, monkeypatch):
  monkeypatch.setenv(layouts.ENV_VAR, 'native')  # as on a GPU or TPU
  policy = QuantPolicy((QuantRule('.*', int_format(4, group_size=16)),), path='dequant')
  qmodel = quantize_model(Transformer(CFG, rngs=nnx.Rngs(0)), policy)[0]
  assert _dtypes(qmodel) == {jnp.dtype(jnp.int4)}
  record = {f: 'none' for f in REQUIRED_FIELDS if f not in ('runtime', 'hardware', 'artifacts')}
  save_quantized(str(tmp_path), qmodel, policy, record)
  assert _dtypes(qmodel) == {jnp.dtype(jnp.int4)}  # the caller's model is left as it was
  logits = lambda m: np.asarray(nnx.jit(lambda m, t: m(t))(m, TOKENS))  # noqa: E731
  loaded, _ = load_quantized(str(tmp_path))  # verified against the packed arrays on disk
  assert _dtypes(loaded) == {jnp.dtype(jnp.int4)}
  np.testing.assert_array_equal(logits(loaded), logits(qmodel))
  monkeypatch.setenv(layouts.ENV_VAR, 'packed')  # as on a CPU
  loaded, _ = load_quantized(str(tmp_path))
  assert _dtypes(loaded) == {jnp.dtype(jnp.uint8)}
  np.testing.assert_allclose(logits(loaded), logits(qmodel), rtol=1e-5, atol=1e-5)
