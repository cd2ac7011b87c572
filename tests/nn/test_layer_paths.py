"""Records state what ran: each quantized layer's qeinsum path and reason at decode and prefill
shapes (`qjax.nn.layer_paths`), for a mixed policy, on the CPU and on a compile-only TPU."""

import jax.numpy as jnp
from flax import nnx

from qjax import checkpoints as qckpt
from qjax import kernels
from qjax import target as qjax_target
from qjax.core import int_format
from qjax.nn import (QuantPolicy, QuantRule, Transformer, TransformerConfig, layer_paths,
                     quantize_model, relayout_model)
from qjax.pipeline import resolved_path

CFG = TransformerConfig.tiny(num_layers=1, head_dim=16, num_heads=4, num_kv_heads=2,
                             vocab_size=4096, d_model=128, d_ff=256)
V5E = qjax_target.Target('tpu', 'TPU v5 lite', compile_only=True, source='test')
MIXED = QuantPolicy((QuantRule(r'.*attn.*', int_format(8)),
                     QuantRule(r'.*mlp.*', int_format(4, group_size=32)),
                     QuantRule(r'embed', int_format(8), act=int_format(8))))


def _model():
  model = Transformer(CFG, rngs=nnx.Rngs(0))
  return quantize_model(model, MIXED)[0]


def test_a_mixed_policy_names_each_layers_path_and_reason():
  model = _model()
  ran = layer_paths(model, batch=1, prefill_tokens=64)
  assert set(ran) >= {'layers/0/attn/q_proj', 'layers/0/mlp/up_proj', 'embed'}
  decode_kernel = 'kernel' if kernels.available() else 'tiled'
  assert ran['layers/0/attn/q_proj']['decode']['path'] == decode_kernel
  assert ran['layers/0/mlp/up_proj']['prefill']['path'] == 'tiled'
  assert ran['layers/0/mlp/up_proj']['decode']['reason'].startswith('auto on cpu')
  # W8A8 head (V, D): the kernel's integer dots at decode where built; 64 rows are past its
  # 16, and without the kernel the reason says why it was not used
  assert ran['embed']['prefill']['path'] in ('vblocks', 'int_dot')
  kernel_refusal = ('kernel: 64 rows > 16' if kernels.available()
                    else f'kernel: the CPU kernel is {kernels.status()}')
  assert kernel_refusal in ran['embed']['prefill']['reason']
  # the same model traced for a TPU, its codes in the TPU's layout
  native = relayout_model(model, 'native')
  with qjax_target.use(V5E):
    tpu = layer_paths(native)
  assert tpu['layers/0/mlp/up_proj']['decode']['path'] == 'pallas_tpu'
  assert tpu['layers/0/attn/k_proj']['decode']['path'] == 'pallas_tpu'  # N = 32: one block
  assert tpu['layers/0/attn/q_proj']['prefill']['path'] == 'pallas_tpu'
  assert tpu['embed']['decode']['path'] == 'int_dot'  # W8A8: XLA's int8 x int8 dot


def test_the_conversion_record_carries_them():
  model = _model()
  summary = resolved_path(MIXED, model)
  assert 'per layer in compute_path.layers' in summary and 'on cpu' in summary
  record = qckpt.conversion_record(
      base_checkpoint={'sha256': '0', 'source': 'test'}, tokenizer='t', source_dtype='float32',
      layers=[], group_size=None, granularity='channel', method='rtn', scale_method='absmax',
      zero_point_method='none', calibration={}, compute_dtype='float32',
      compute_path={'policy': MIXED.path, 'resolved': summary, 'layers': layer_paths(model)},
      kv_cache_format='float32', evaluation={})
  layers = record['compute_path']['layers']
  decoded = {v['decode']['path'] for v in layers.values()}
  # without the kernel: the projections tiled; the W8A8 head (4096 rows, one V block) on XLA's
  # integer dot
  assert decoded == ({'kernel'} if kernels.available() else {'tiled', 'int_dot'}), decoded
  assert all(set(v) == {'decode', 'prefill'} for v in layers.values())
  assert jnp.asarray(1)  # the record is plain data (no arrays)
