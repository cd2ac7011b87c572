"""The engine's mixed steps through the ragged paged kernel (Pallas interpret mode on CPU)
give the scan's greedy tokens; a packed step's attention through it equals the scan's; and
where `attention_form` picks it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax import target as qjax_target
from qjax.infer import Engine, EngineConfig, SamplingParams, init_paged_cache, with_step
from qjax.infer import paged_kernel
from qjax.infer.paged_kernel import attention_form
from qjax.kernels import ragged_paged
from qjax.nn import Transformer, TransformerConfig

# A sliding-window layer (a ring of pages) and a global one, a logit softcap, GQA.
CFG = TransformerConfig.tiny(sliding_window=6, global_every=2, attn_logit_softcap=30.0,
                             max_len=48)


def _count_calls(monkeypatch):
  calls = []
  real = ragged_paged.ragged_paged_attention

  def counted(*args, **kwargs):
    calls.append(kwargs.get('interpret'))
    return real(*args, **kwargs)
  monkeypatch.setattr(ragged_paged, 'ragged_paged_attention', counted)
  return calls


def test_engine_greedy_tokens_through_the_ragged_kernel_equal_the_scan(monkeypatch):
  """Three requests on two rows, int8 pages: chunks of 4 beside decodes, and chunks alone."""
  model = Transformer(CFG, rngs=nnx.Rngs(0))
  keys = jax.random.split(jax.random.key(3), 3)
  prompts = [np.asarray(jax.random.randint(k, (n,), 0, CFG.vocab_size)).tolist()
             for k, n in zip(keys, (7, 2, 10))]
  params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (5, 6, 3)]
  calls = _count_calls(monkeypatch)
  outs = {}
  # Pool sizes of their own: executables of equal shapes are shared, and each mode must trace.
  for mode, pages in (('scan', 37), ('interpret', 39)):
    monkeypatch.setenv('QJAX_PAGED_ATTENTION', mode)
    engine = Engine(model, EngineConfig(max_batch=2, page_size=4, num_pages=pages,
                                        chunk_size=4, kv_format='int8', decode_block=1))
    outs[mode] = engine.generate(prompts, params)
    assert (mode == 'interpret') == bool(calls), (mode, calls)
  assert outs['interpret'] == outs['scan']
  assert all(calls)  # in interpret mode, one call per layer and mixed bucket traced


def test_a_packed_mixed_step_attends_as_the_scan(monkeypatch, paged_logits_step):
  """fp8 pages (the engine test has int8; the kernel's tests every format). Rows cached 6
  and 3 tokens deep; then one step: a chunk of 3 beside a decode."""
  model = Transformer(CFG, rngs=nnx.Rngs(0))
  cache = init_paged_cache(CFG, num_pages=12, page_size=4, batch=2, max_pages=4,
                           ring_pages=3, num_ring_pages=7, fmt='fp8')
  table, rings = np.array([[5, 2, 8, 0], [3, 9, 0, 0]]), np.array([[1, 4, 6], [2, 3, 5]])
  tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, CFG.vocab_size)
  _, cache = paged_logits_step(model)(tokens, with_step(cache, table, rings, [0, 0], [6, 3]))
  step = with_step(cache, table, rings, [6, 3], [3, 1], seq_of=[0, 0, 0, 1, 0],
                   slot_of=[0, 1, 2, 0, 3], att_width=3, att_wide=1)
  tokens_M1 = tokens.reshape(-1)[:5, None]
  calls = _count_calls(monkeypatch)
  logits = {}
  for mode in ('scan', 'interpret'):
    monkeypatch.setenv('QJAX_PAGED_ATTENTION', mode)
    logits[mode] = np.asarray(paged_logits_step(model)(tokens_M1, step)[0])[:4]
  assert len(calls) == CFG.num_layers  # one ragged call per layer for the whole step
  want = logits['scan']
  np.testing.assert_allclose(logits['interpret'], want, atol=2e-4 * np.abs(want).max())


def test_attention_form_picks_the_ragged_kernel_for_chunks_on_one_tpu(monkeypatch):
  monkeypatch.delenv('QJAX_PAGED_ATTENTION', raising=False)
  pool = jnp.zeros((4, 16, 2, 64), jnp.bfloat16)
  form = attention_form(pool, 8, on='tpu', devices=1)
  assert (form.name, form.backend, form.kernel) == ('kernel', 'mosaic', 'ragged'), form
  decode = attention_form(pool, 1, on='tpu', devices=1)
  assert (decode.kernel, decode.backend) == ('paged', 'mosaic')  # split-K, no empty slots
  gpu = attention_form(pool, 8, on='nvidia', devices=1)
  assert gpu.name == 'scan' and 'Mosaic (TPU) only' in gpu.reason
  assert attention_form(pool, 8, on='cpu').name == 'scan'
  assert 'may be sharded' in attention_form(pool, 8, on='tpu', devices=4).reason
  with qjax_target.use(qjax_target.Target('tpu', 'TPU v5 lite')):
    assert attention_form(pool, 8).kernel == 'ragged'
  monkeypatch.setenv('QJAX_PAGED_ATTENTION', 'interpret')
  form = attention_form(pool, 8, on='cpu')
  assert (form.name, form.kernel) == ('interpret', 'ragged')
  monkeypatch.setenv('QJAX_PAGED_ATTENTION', 'kernel')
  assert attention_form(pool, 8, on='nvidia').name == 'scan'  # no ragged Triton kernel
  with pytest.raises(ValueError, match='t=0 queries per row'):
    attention_form(pool, 0)
  with pytest.raises(ValueError, match='is not the ragged kernel'):
    paged_kernel.attend_packed(attention_form(pool, 1, on='tpu'), pool, pool,
                               *([None] * 6), 1, ring=False, window=None,
                               logit_softcap=None)
