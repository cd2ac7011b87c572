"""Paged decode through the attention kernel (Pallas interpret mode on CPU) == the XLA scan,
for every KV format, ring pages, windows and softcaps; and where the kernel is chosen."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax.core import int_format, quantize
from qjax.infer import init_paged_cache, with_step
from qjax.infer.paged_kernel import attention_form
from qjax.kernels import paged_attention
from qjax.nn import Transformer, TransformerConfig, with_kv_format

CFG = TransformerConfig.tiny(sliding_window=5, global_every=2, attn_logit_softcap=30.0,
                             max_len=32)


@pytest.mark.parametrize('fmt', [None, 'int8', 'int4', 'fp8'])
def test_kernel_decode_equals_scan_decode(fmt, monkeypatch, paged_logits_step):
  """Two ragged rows (6 and 3 tokens, a ring that wrapped) prefill, then one decode step."""
  model = with_kv_format(Transformer(CFG, rngs=nnx.Rngs(0)), fmt)
  cache = init_paged_cache(CFG, num_pages=10, page_size=4, batch=2, max_pages=4,
                           ring_pages=3, num_ring_pages=7, fmt=fmt)
  table, rings = np.array([[5, 2, 8, 0], [3, 9, 0, 0]]), np.array([[1, 4, 6], [2, 3, 5]])
  tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, CFG.vocab_size)
  _, cache = paged_logits_step(model)(tokens, with_step(cache, table, rings, [0, 0], [6, 3]))
  cache = with_step(cache, table, rings, [6, 3], [1, 1])
  logits = {}
  for mode in ('scan', 'interpret'):
    monkeypatch.setenv('QJAX_PAGED_ATTENTION', mode)
    logits[mode] = np.asarray(paged_logits_step(model)(tokens[:, :1], cache)[0])
  want = logits['scan']
  np.testing.assert_allclose(logits['interpret'], want, atol=2e-4 * np.abs(want).max())


def test_attention_form_per_platform_pool_and_override(monkeypatch):
  monkeypatch.delenv('QJAX_PAGED_ATTENTION', raising=False)
  pool = jnp.zeros((4, 16, 2, 64), jnp.bfloat16)
  assert attention_form(pool, 1, on='cpu').name == 'scan'
  one = lambda pool, t, on: attention_form(pool, t, on=on, devices=1)
  assert (one(pool, 1, 'nvidia').name, one(pool, 1, 'nvidia').backend) == ('kernel', 'triton')
  assert (one(pool, 1, 'tpu').name, one(pool, 1, 'tpu').backend) == ('kernel', 'mosaic')
  assert one(pool, 4, 'tpu').kernel == 'ragged'  # a prefill chunk: the ragged kernel
  assert 'may be sharded' in attention_form(pool, 1, on='tpu', devices=4).reason
  odd = jnp.zeros((4, 12, 2, 64))
  assert 'powers of two' in one(odd, 1, 'nvidia').reason
  assert one(odd, 1, 'tpu').name == 'kernel'
  grouped = quantize(pool.astype(jnp.float32), int_format(8, group_size=32, group_axis=3,
                                                          channel_axes=(0, 1, 2)))
  assert 'one scale per token' in one(grouped, 1, 'nvidia').reason
  monkeypatch.setenv('QJAX_PAGED_ATTENTION', 'scan')
  assert one(pool, 1, 'nvidia').name == 'scan'
  monkeypatch.delenv('QJAX_PAGED_ATTENTION')
  # A jax without the Pallas Triton backend (deprecated in jax 0.12) keeps the scan.
  monkeypatch.setattr(paged_attention, 'backend_available', lambda b: b != 'triton')
  assert one(pool, 1, 'nvidia').name == 'scan'
  assert 'no Pallas triton backend' in one(pool, 1, 'nvidia').reason
  assert one(pool, 1, 'tpu').name == 'kernel'
  monkeypatch.setenv('QJAX_PAGED_ATTENTION', 'fast')
  with pytest.raises(ValueError, match="QJAX_PAGED_ATTENTION='fast' is unknown"):
    attention_form(pool, 1)


def test_the_pallas_backends_of_the_installed_jax():
  # jax 0.10 to 0.12 ship both (0.12 deprecates Triton); 'auto' consults this before it
  # chooses the kernel.
  if jax.__version_info__ < (0, 13):
    assert paged_attention.backend_available('triton')
  assert paged_attention.backend_available('mosaic')
  with pytest.raises(ValueError, match="backend='cuda' is unknown"):
    paged_attention.backend_available('cuda')
