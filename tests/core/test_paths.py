"""The quantized matmul's table of paths (qjax.core.paths): the chooser, the named-path
contract, every path against a float64 reference, and the table-row lookup."""

import dataclasses
import logging
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qjax import fp8_format, int_format, qeinsum, quantize
from qjax import kernels
from qjax import target as qjax_target
from qjax.core import layouts, paths
from qjax.kernels import tpu_gather

CPU = qjax_target.Target('cpu', 'cpu', source='test')
V5E = qjax_target.Target('tpu', 'TPU v5 lite', compile_only=True, source='test')
H200 = qjax_target.Target('nvidia', 'NVIDIA H200', compute_capability=(9, 0), compile_only=True,
                          source='test')
KEY = jax.random.split(jax.random.key(11), 4)


def _q(shape, fmt, layout='packed', key=0):
  q = quantize(jax.random.normal(KEY[key], shape) / 16, fmt)
  return layouts.to_layout(q, layout)


def _pick(spec, x_shape, w, target, path='auto', act=None):
  return paths.describe(spec, x_shape, w, act_fmt=act, path=path, target=target)


def _f64(spec, x, w):
  """The float64 reference: x times the dequantized weight, in numpy float64."""
  return np.einsum(spec, np.asarray(x, np.float64), np.asarray(w.dequantize(), np.float64))


# ---------------------------------------------------------------------------------- chooser
def test_auto_rows_of_the_table():
  g128 = int_format(4, group_size=128, channel_axes=(1,))
  ch8 = int_format(8, channel_axes=(1,))
  kn_native = _q((256, 256), g128, 'native')
  kn_packed = _q((256, 256), g128)
  head = _q((512, 256), int_format(8, channel_axes=(0,), group_axis=1), 'native')
  # CPU: kernel at decode when built, tiles at prefill, V blocks (or the reference) for a head
  decode = _pick('BTD,DF->BTF', (1, 1, 256), kn_packed, CPU).path
  assert decode == ('kernel' if kernels.available() else 'tiled')
  assert _pick('BTD,DF->BTF', (1, 512, 256), kn_packed, CPU).path == 'tiled'
  # TPU: the Mosaic kernel at every row count, for projections and the head
  for rows in (1, 8, 512):
    assert _pick('BTD,DF->BTF', (1, rows, 256), kn_native, V5E).path == 'pallas_tpu'
  assert _pick('BTD,VD->BTV', (1, 1, 256), head, V5E).path == 'pallas_tpu'
  assert _pick('BTD,DF->BTF', (1, 1, 256), _q((256, 256), ch8, 'native'), V5E).path == \
      'pallas_tpu'
  # hand-packed codes on a TPU: the reference, with every refusal in the reason
  c = _pick('BTD,DF->BTF', (1, 1, 256), kn_packed, V5E)
  assert c.path == 'dequant' and 'pallas_tpu:' in c.reason and 'native:' in c.reason
  # NVIDIA: per-channel int8 codes fuse into XLA's dot; grouped and int4 ones take Triton at
  # every row count (at prefill XLA wrote them dequantized), the head at decode rows
  assert _pick('BTD,DF->BTF', (1, 1, 256), _q((256, 256), ch8, 'native'), H200).path == 'native'
  assert _pick('BTD,DF->BTF', (1, 512, 256), _q((256, 256), ch8, 'native'), H200).path == \
      'native'
  int4_ch = _q((256, 256), int_format(4, channel_axes=(1,)), 'native')
  for rows in (1, 8, 512):
    assert _pick('BTD,DF->BTF', (1, rows, 256), kn_native, H200).path == 'pallas_gpu'
    assert _pick('BTD,DF->BTF', (1, rows, 256), int4_ch, H200).path == 'pallas_gpu'
  head4 = _q((512, 256), int_format(4, group_size=128, channel_axes=(0,), group_axis=1),
             'native')
  assert _pick('BTD,VD->BTV', (1, 8, 256), head4, H200).path == 'pallas_gpu'
  c = _pick('BTD,VD->BTV', (1, 512, 256), head4, H200)
  assert c.path == 'native' and 'decode shapes' in c.reason
  # quantized activations: one integer dot off CPU
  assert _pick('BTD,DF->BTF', (1, 8, 256), _q((256, 256), ch8), V5E,
               act=int_format(8)).path == 'int_dot'


def test_tpu_kernel_refusals_name_the_reason():
  asym = _q((256, 256), int_format(4, group_size=32, channel_axes=(1,), symmetric=False),
            'native')
  c = _pick('BTD,DF->BTF', (1, 1, 256), asym, V5E)
  assert c.path == 'native' and 'zero points' in c.reason
  odd = _q((256, 520), int_format(8, channel_axes=(1,)), 'native')  # N = 520: no 128 block
  c = _pick('BTD,DF->BTF', (1, 1, 256), odd, V5E)
  assert c.path == 'native' and 'multiple of 128' in c.reason


@pytest.mark.parametrize('group', [32, 64, 128])
def test_tpu_kernel_takes_every_group_size_qjax_offers(group):
  # (8, 128) rule: 8 groups per K block (or all of K) keep each scale block legal
  w = _q((1024, 512), int_format(4, group_size=group, channel_axes=(1,)), 'native')
  assert _pick('BTD,DF->BTF', (1, 1, 1024), w, V5E).path == 'pallas_tpu'
  # o_proj's N*H grouping of head_dim-64 models: groups run along the flattened contraction
  # (groups of 128 span two heads of 64; shorter ones have a scale per head)
  channels = (0, 2) if group <= 64 else (2,)
  o = _q((4, 64, 256), int_format(4, group_size=group, group_axis=1, channel_axes=channels),
         'native')
  assert _pick('BTNH,NHD->BTD', (1, 1, 4, 64), o, V5E).path == 'pallas_tpu'


def test_named_paths_run_what_they_name_or_say_why():
  w = _q((256, 256), int_format(4, group_size=64, channel_axes=(1,)), 'native')
  with pytest.raises(ValueError, match=r"path='kernel' cannot run.*the target is tpu"):
    _pick('BTD,DF->BTF', (1, 1, 256), w, V5E, path='kernel')
  asym = _q((256, 256), int_format(8, channel_axes=(1,), symmetric=False), 'native')
  with pytest.raises(ValueError, match=r"path='pallas_tpu' cannot run.*zero points"):
    _pick('BTD,DF->BTF', (1, 1, 256), asym, V5E, path='pallas_tpu')
  # a named path with a documented fallback records it as one
  c = _pick('BTD,DF->BTF', (1, 512, 256), asym, H200, path='pallas')
  assert c.path == 'native' and c.fallback and 'not symmetric' in c.reason
  for rows in (8, 512):
    assert not _pick('BTD,DF->BTF', (1, rows, 256), w, H200, path='pallas').fallback


def test_a_fallback_is_logged_once(caplog):
  w = _q((4, 64, 32), int_format(4, group_size=32, group_axis=1, channel_axes=(2,)))
  x = jax.random.normal(KEY[1], (2, 4, 3, 64))  # 'BNTH': a batch axis shared with w: no tiles
  spec = 'BNTH,NHD->BTD'
  with caplog.at_level(logging.WARNING, logger='qjax.core.paths'):
    for _ in range(3):
      y = qeinsum('BNTH,NHD->BTD', x, w, path='tiled')
  logged = [r for r in caplog.records if spec in r.getMessage()]
  assert len(logged) <= 1  # once per process and reason (an earlier test may have logged it)
  np.testing.assert_allclose(y, _f64(spec, x, w), rtol=1e-5, atol=1e-5)


def test_path_modules_never_read_the_target():
  # choose() is the one reader; the modules get the target handed to them.
  src = pathlib.Path(paths.__file__).parent
  for name in paths.MODULES:
    text = (src / f'{paths.MODULES[name].__name__.rsplit(".", 1)[1]}.py').read_text()
    assert 'qjax_target' not in text and 'default_backend' not in text, name


# ------------------------------------------------------------ every path vs float64 numpy
KN = [int_format(8, channel_axes=(1,)), int_format(4, channel_axes=(1,)),
      int_format(4, group_size=32, channel_axes=(1,)),
      int_format(4, group_size=64, channel_axes=(1,)),
      int_format(4, group_size=128, channel_axes=(1,)), fp8_format('e4m3', channel_axes=(1,))]


@pytest.mark.parametrize('fmt', KN, ids=lambda f: f.name)
def test_pallas_tpu_in_interpret_mode_matches_float64(fmt):
  w = _q((256, 384), fmt, 'native')
  for rows in (1, 5):
    x = jax.random.normal(KEY[2], (1, rows, 256))
    y = qeinsum('BTD,DF->BTF', x, w, path='pallas_tpu')
    np.testing.assert_allclose(y, _f64('BTD,DF->BTF', x, w), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize('fmt', [int_format(8, channel_axes=(0,), group_axis=1),
                                 int_format(4, group_size=128, channel_axes=(0,), group_axis=1)],
                         ids=lambda f: f.name)
def test_pallas_tpu_head_layout_matches_float64(fmt):
  w = _q((384, 256), fmt, 'native')
  x = jax.random.normal(KEY[3], (2, 3, 256))
  y = qeinsum('BTD,VD->BTV', x, w, path='pallas_tpu')
  np.testing.assert_allclose(y, _f64('BTD,VD->BTV', x, w), rtol=2e-5, atol=2e-5)


def test_pallas_tpu_o_proj_grouping_matches_float64():
  w = _q((4, 64, 256), int_format(4, group_size=128, group_axis=1, channel_axes=(2,)), 'native')
  assert w.tile_shape == (2, 64, 1)  # groups of 128 cover two heads of 64
  x = jax.random.normal(KEY[0], (1, 3, 4, 64))
  y = qeinsum('BTNH,NHD->BTD', x, w, path='pallas_tpu')
  np.testing.assert_allclose(y, _f64('BTNH,NHD->BTD', x, w), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize('path', ['auto', 'tiled', 'dequant', 'native', 'int8', 'pallas_gpu'])
def test_cpu_and_xla_paths_match_float64(path):
  fmt = int_format(4, group_size=64, channel_axes=(1,))
  w = _q((256, 256), fmt, 'native' if path in ('native', 'pallas_gpu') else 'packed')
  x = jax.random.normal(KEY[1], (1, 4, 256))
  y = qeinsum('BTD,DF->BTF', x, w, path=path)
  ref = _f64('BTD,DF->BTF', x, w)
  if path == 'int8':  # W8A8 numerics: int8 activations
    err = np.abs(np.asarray(y, np.float64) - ref).max() / np.abs(ref).max()
    assert err < 2e-2, err
  else:  # bf16 tiles where the CPU has bf16 dots: ~3 significant digits
    np.testing.assert_allclose(y, ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())


# ------------------------------------------------------------------------- table lookup
def test_lookup_is_the_indexed_rows_everywhere():
  ids = jnp.array([[0, 7, 300], [511, 8, 9]])
  for table in (_q((512, 256), int_format(8, channel_axes=(0,), group_axis=1), 'native'),
                _q((512, 256), int_format(4, group_size=128, channel_axes=(0,), group_axis=1),
                   'native'),
                jax.random.normal(KEY[2], (512, 256)).astype(jnp.bfloat16)):
    ref = (table[ids].dequantize() if hasattr(table, 'qtype') else table[ids])
    np.testing.assert_array_equal(paths.lookup(table, ids, jnp.float32, target=CPU),
                                  np.asarray(ref, np.float32))
    data = table.data if hasattr(table, 'qtype') else table
    np.testing.assert_array_equal(
        tpu_gather.gather_rows(data, ids.reshape(-1), interpret=True),
        np.asarray(data[ids.reshape(-1)].astype(jnp.float32)))
  assert paths.rows.form(table, V5E)[0] == 'kernel'
  assert paths.rows.form(table, dataclasses.replace(V5E, platform='cpu'))[0] == 'index'
  # The TPU form's scale rows: a column slice per id at decode, XLA's gather beyond
  scale = jax.random.normal(KEY[3], (512, 5))
  for n in (3, 65):
    flat = jnp.arange(n) * 7 % 512
    np.testing.assert_array_equal(paths.rows._rows(scale, flat, 1024), scale[flat // 2])


def test_tpu_kernels_stay_off_a_partitioned_program():
  w = _q((256, 256), int_format(4, group_size=64, channel_axes=(1,)), 'native')
  slice8 = dataclasses.replace(V5E, device_count=8)
  c = _pick('BTD,DF->BTF', (1, 1, 256), w, slice8)
  assert c.path == 'native' and '8 devices' in c.reason
  assert paths.rows.form(w, slice8)[0] == 'index'


@pytest.mark.parametrize('fmt', [int_format(8, channel_axes=(0,), group_axis=1),
                                 int_format(4, group_size=128, channel_axes=(0,), group_axis=1)],
                         ids=lambda f: f.name)
@pytest.mark.parametrize('layout', ['packed', 'native'])
def test_pallas_gpu_head_layout_matches_float64(fmt, layout):
  w = _q((384, 256), fmt, layout)
  x = jax.random.normal(KEY[3], (2, 3, 256))
  y = qeinsum('BTD,VD->BTV', x, w, path='pallas_gpu')
  np.testing.assert_allclose(y, _f64('BTD,VD->BTV', x, w), rtol=2e-5, atol=2e-5)
  g128 = _q((384, 256), int_format(4, group_size=128, channel_axes=(0,), group_axis=1), 'native')
  assert _pick('BTD,VD->BTV', (1, 8, 256), g128, H200).path == 'pallas_gpu'


def test_int_dot_matches_an_integer_float64_reference():
  # W8A8 on the whole operands (the path off CPU): per-token int8 activations times the codes
  w = _q((256, 128), int_format(8, channel_axes=(1,)), 'native')
  x = jax.random.normal(KEY[0], (1, 3, 256))
  call = paths.Call.of('BTD,DF->BTF', x, w, 'int')
  y = paths.int_dot.run(call, x, w, jnp.float32, target=V5E, asked=False)
  xn = np.asarray(x, np.float64).reshape(3, 256)
  sx = np.abs(xn).max(1, keepdims=True) / 127.0
  xq = np.clip(np.round(xn / sx), -127, 127)
  ref = (xq @ np.asarray(w.codes(), np.float64)) * sx * np.asarray(w.scale, np.float64)
  np.testing.assert_allclose(np.asarray(y).reshape(3, 128), ref, rtol=1e-5,
                             atol=1e-5 * np.abs(ref).max())
