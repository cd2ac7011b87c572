"""The native storage layout (jnp.int4 / int8 / fp8 codes) and qeinsum's native path: the same
numbers as the packed layout and the float64 quantize-dequantize reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax import fp8_format, int_format, qeinsum, quantize
from qjax.core import layouts
from qjax.core.qarray import QArray, QType, int4_bits
from qjax.core.qdot import choose_path

K = jax.random.split(jax.random.key(3), 4)
W_DF = jax.random.normal(K[0], (256, 96)) / 16

FORMATS = [
    int_format(4, channel_axes=(1,)),                                  # per-channel
    int_format(4, channel_axes=(1,), symmetric=False),
    int_format(4, group_size=64, channel_axes=(1,)),                   # grouped
    int_format(4, group_size=32, channel_axes=(1,), symmetric=False),
    int_format(3, group_size=64, channel_axes=(1,)),
    int_format(8, channel_axes=(1,)),
    int_format(8, group_size=128, channel_axes=(1,)),
    fp8_format('e4m3', channel_axes=(1,)),
    fp8_format('e4m3', group_size=64, channel_axes=(1,)),
]


def _ref64(x, q):
  """float64 x @ dequantize(q), from the codes and scales alone."""
  c = np.asarray(q.codes().astype(jnp.float32), np.float64)
  s = np.asarray(qjax.broadcast_scale(q.scale.astype(jnp.float32), q.shape), np.float64)
  z = 0.0 if q.zero_point is None else np.asarray(
      qjax.broadcast_scale(q.zero_point.astype(jnp.float32), q.shape), np.float64)
  return np.asarray(x, np.float64) @ ((c - z) * s)


def test_native_layout_stores_xla_dtypes_and_round_trips():
  for fmt, dtype in [(int_format(4, channel_axes=(1,)), jnp.int4),
                     (int_format(2, channel_axes=(1,)), jnp.int4),
                     (int_format(8), jnp.int8), (fp8_format('e4m3'), jnp.float8_e4m3fn)]:
    q = quantize(W_DF, fmt)
    n = layouts.to_layout(q, 'native')
    assert n.qtype.layout == 'native' and n.data.dtype == dtype and n.data.shape == q.shape
    np.testing.assert_array_equal(n.codes(), q.codes())
    np.testing.assert_array_equal(n.dequantize(), q.dequantize())
    back = layouts.to_layout(n, 'packed')
    assert back.qtype == q.qtype
    np.testing.assert_array_equal(back.data, q.data)


def test_nbytes_counts_what_the_backend_holds():
  q = quantize(W_DF, int_format(4, channel_axes=(1,)))
  n = layouts.to_layout(q, 'native')
  bits = int4_bits()
  assert bits in (4, 8)
  assert n.nbytes == W_DF.size * bits // 8 + q.scale.nbytes
  assert q.nbytes == W_DF.size // 2 + q.scale.nbytes  # packed: two codes a byte everywhere
  big = layouts.to_layout(quantize(jnp.ones((512, 1024)), int_format(4)), 'native')
  assert int(big.data.on_device_size_in_bytes()) == 512 * 1024 * bits // 8


def test_layout_choice_per_backend_and_override(monkeypatch):
  monkeypatch.delenv(layouts.ENV_VAR, raising=False)
  assert layouts.default_layout('cpu') == 'packed'
  assert layouts.default_layout('gpu') == 'native' and layouts.default_layout('tpu') == 'native'
  monkeypatch.setenv(layouts.ENV_VAR, 'native')
  assert layouts.default_layout('cpu') == 'native'
  monkeypatch.setenv(layouts.ENV_VAR, 'int4')
  with pytest.raises(ValueError, match="QJAX_QARRAY_LAYOUT='int4' is not a QArray layout"):
    layouts.default_layout()
  with pytest.raises(ValueError, match="layout='nibbles' is unknown"):
    layouts.to_layout(quantize(W_DF, int_format(8)), 'nibbles')
  with pytest.raises(ValueError, match="layout='s4' is unknown"):
    QType('int', 4, 's4')


def test_auto_path_per_backend_and_layout():
  f4 = int_format(4, group_size=128)
  assert choose_path(f4, backend='cpu') == 'tiled'
  assert choose_path(f4, backend='gpu', layout='native') == 'native'
  assert choose_path(f4, backend='tpu', layout='packed') == 'dequant'
  assert choose_path(QType('int', 4, 'native'), backend='gpu') == 'native'
  assert choose_path(QType('int', 4, 'packed'), backend='gpu') == 'dequant'
  assert choose_path(QType('int', 8, 'packed'), backend='gpu') == 'native'  # same bytes
  assert choose_path(fp8_format(), fp8_format(), backend='gpu') == 'fp8'
  assert choose_path(int_format(8), int_format(8), backend='tpu') == 'int8'


class NativePathTest(chex.TestCase):

  def test_native_equals_packed_and_float64_reference(self):
    for fmt in FORMATS:
      q = quantize(W_DF, fmt)
      n = layouts.to_layout(q, 'native')
      for m in (1, 64):  # decode and prefill rows
        x = jax.random.normal(K[1], (m, 256))
        ref = _ref64(x, q)
        y = np.asarray(qjax.qdot(x, n, path='native'))
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4, err_msg=fmt.name)
        if m == 1:
          np.testing.assert_allclose(y, qjax.qdot(x, q, path='dequant'), rtol=1e-4, atol=1e-4,
                                     err_msg=fmt.name)
          np.testing.assert_allclose(y, qjax.qdot(x, q, path='native'), rtol=1e-4, atol=1e-4,
                                     err_msg=fmt.name)
        else:
          # The CPU default runs native codes too (the tiled path reads one code per element;
          # bf16 tiles at M >= 2 where the CPU has bf16 dots: ~50 dB, as for packed codes).
          assert float(qjax.sqnr_db(ref, qjax.qdot(x, n))) > 45.0, fmt.name

  @chex.variants(with_jit=True, without_jit=True)
  def test_native_path_under_jit(self):
    x = jax.random.normal(K[1], (4, 256))
    for fmt in (FORMATS[1], FORMATS[3]):  # per-channel and grouped, both asymmetric
      n = layouts.to_layout(quantize(W_DF, fmt), 'native')
      y = self.variant(lambda x, w: qjax.qdot(x, w, path='native'))(x, n)
      np.testing.assert_allclose(y, _ref64(x, n), rtol=1e-4, atol=1e-4, err_msg=fmt.name)

  def test_bf16_activations_stay_within_bf16_rounding(self):
    x = jax.random.normal(K[1], (8, 256))
    for fmt in FORMATS:
      n = layouts.to_layout(quantize(W_DF, fmt), 'native')
      y = qjax.qdot(x.astype(jnp.bfloat16), n, path='native')
      assert y.dtype == jnp.bfloat16
      assert float(qjax.sqnr_db(_ref64(x, n), y.astype(jnp.float32))) > 40.0, fmt.name

  def test_three_axis_spec_with_heads(self):
    """q_proj-like 'BTD,DNH->BTNH' and o_proj-like 'BTNH,NHD->BTD' (two contracted axes)."""
    x_btd = jax.random.normal(K[2], (2, 3, 64))
    w_dnh = jax.random.normal(K[3], (64, 4, 16)) / 8
    for fmt in (int_format(4, channel_axes=(1, 2)),
                int_format(4, group_size=32, channel_axes=(1, 2))):
      q = layouts.to_layout(quantize(w_dnh, fmt), 'native')
      y = qeinsum('BTD,DNH->BTNH', x_btd, q, path='native')
      ref = jnp.einsum('BTD,DNH->BTNH', x_btd, q.dequantize())
      np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    x_btnh = jax.random.normal(K[2], (2, 3, 4, 16))
    w_nhd = jax.random.normal(K[3], (4, 16, 64)) / 8
    for fmt in (int_format(8, channel_axes=(2,), symmetric=False),
                int_format(4, group_size=16, group_axis=1, channel_axes=(2,))):
      q = layouts.to_layout(quantize(w_nhd, fmt), 'native')
      y = qeinsum('BTNH,NHD->BTD', x_btnh, q, path='native')
      ref = jnp.einsum('BTNH,NHD->BTD', x_btnh, q.dequantize())
      np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_fp8_weight_only_and_fp8_x_fp8_on_native_codes():
  x = jax.random.normal(K[1], (16, 256))
  for fmt in (fp8_format('e4m3', channel_axes=(1,)),
              fp8_format('e4m3', group_size=64, channel_axes=(1,))):
    q = layouts.to_layout(quantize(W_DF, fmt), 'native')
    assert q.data.dtype == jnp.float8_e4m3fn
    ref = _ref64(x, q)
    np.testing.assert_allclose(qjax.qdot(x, q, path='native'), ref, rtol=1e-4, atol=1e-4)
    # fp8 x fp8: activations quantized per token (and weight group) to e4m3, f32 accumulation.
    y = qjax.qdot(x, q, act_fmt=fp8_format('e4m3'))
    xs = np.abs(np.asarray(x)).max(1, keepdims=True) / 448.0
    xq = np.asarray(jnp.asarray(np.asarray(x) / xs).astype(jnp.float8_e4m3fn)
                    .astype(jnp.float32), np.float64) * xs
    if fmt.group_size is None:  # the independent reference: fp8 activations times the weight
      np.testing.assert_allclose(y, _ref64(xq, q), rtol=1e-4, atol=1e-4)
    assert float(qjax.sqnr_db(ref, y)) > 25.0


def test_relayout_converts_every_qarray_in_a_tree():
  tree = {'a': quantize(W_DF, int_format(4, channel_axes=(1,))), 'b': jnp.ones(3),
          'c': [quantize(W_DF, fp8_format())]}
  out = layouts.relayout(tree, 'native')
  assert out['a'].data.dtype == jnp.int4 and out['c'][0].qtype.layout == 'native'
  assert out['b'] is tree['b']
  assert isinstance(layouts.relayout(out, 'packed')['a'], QArray)
  assert layouts.relayout(out, 'packed')['a'].data.dtype == jnp.uint8


@pytest.mark.backend('gpu', 'tpu', reason='XLA:GPU/TPU fuse the s4 -> bf16 convert into the '
                     'dot; XLA:CPU widens the weight first (docs/quantized_matmul.md)')
def test_no_float_weight_in_the_compiled_native_matmul():
  w = jax.random.normal(K[0], (2048, 2048)) / 32
  q = layouts.to_layout(quantize(w, int_format(4, channel_axes=(1,))), 'native')
  x = jnp.ones((16, 2048), jnp.bfloat16)
  compiled = jax.jit(lambda x, q: qjax.qdot(x, q, path='native')).lower(x, q).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < w.size * 2, f'{temp} temp bytes: a bf16 copy of the weight is materialised'


def test_weight_only_paths_refuse_an_activation_format():
  q = layouts.to_layout(quantize(W_DF, int_format(8, channel_axes=(1,))), 'native')
  for path in ('native', 'pallas'):
    with pytest.raises(ValueError, match=f"path='{path}' is weight-only, but act_fmt=int8"):
      qjax.qdot(jnp.ones((2, 256)), q, act_fmt=int_format(8), path=path)
