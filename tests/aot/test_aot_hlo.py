"""qjax.aot._hlo: bytes moved, custom calls, kernel names and collectives of compiled modules.

CPU modules compiled here give the known answers; the accelerator lines are copied from
modules the TPU and GPU compilers wrote (`qjax.aot.compile_for`), so no toolchain is needed.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from qjax.aot import _hlo

F32_1024 = jax.ShapeDtypeStruct((1024,), jnp.float32)


def _text(fn, *args, **jit_kw) -> str:
  return jax.jit(fn, **jit_kw).lower(*args).compile().as_text()


def test_one_fusion_reads_its_operand_and_writes_its_result():
  assert _hlo.bytes_moved(_text(lambda x: x * 2 + 1, F32_1024)) == 2 * 4096


def test_an_in_place_update_counts_the_update_not_the_buffer():
  """A donated buffer updated by dynamic-update-slice: the 16 new floats (read and written)
  and the index, not the 4 KiB buffer."""
  text = _text(lambda x, v, i: jax.lax.dynamic_update_slice(x, v * 2, (i,)), F32_1024,
               jax.ShapeDtypeStruct((16,), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32),
               donate_argnums=0)
  assert _hlo.bytes_moved(text) == 64 + 4 + 64


def test_an_in_place_scatter_counts_the_updates_not_the_buffer():
  """A donated (B, S, D) cache whose rows each take one new slot (what a KV-cache write is):
  the 2 x 8 new floats and the indices, not the 4 KiB buffer."""
  def write(cache, new, at):
    return jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice_in_dim(c, n, i, 0))(
        cache, new * 2, at)
  text = _text(write, jax.ShapeDtypeStruct((2, 64, 8), jnp.float32),
               jax.ShapeDtypeStruct((2, 1, 8), jnp.float32),
               jax.ShapeDtypeStruct((2,), jnp.int32), donate_argnums=0)
  assert 'scatter' in text
  assert _hlo.bytes_moved(text) < 4 * 64 * 8, _hlo.bytes_moved(text)


def test_a_loop_body_counts_once_per_known_trip():
  def loop(n):
    return lambda x: jax.lax.fori_loop(0, n, lambda i, x: jnp.sin(x) * 2, x)
  five, ten = (_hlo.bytes_moved(_text(loop(n), F32_1024)) for n in (5, 10))
  body = (ten - five) / 5  # the body: the 4 KiB array read and written, plus the counter
  assert 2 * 4096 <= body < 2 * 4096 + 64
  assert five >= 5 * body


def test_a_conditional_counts_its_costliest_branch():
  """One branch reads a 16 KiB operand besides x, the other only x: the costlier counts."""
  costly = lambda x, y: x + y.reshape(4, 1024).sum(0)
  cheap = lambda x, y: x * 2
  args = (jax.ShapeDtypeStruct((), jnp.bool_), F32_1024,
          jax.ShapeDtypeStruct((4096,), jnp.float32))
  moved = lambda a, b: _hlo.bytes_moved(_text(lambda p, x, y: jax.lax.cond(p, a, b, x, y),
                                                *args))
  either, cheapest = moved(costly, cheap), moved(cheap, cheap)
  assert either == moved(costly, costly)
  assert either >= 4 * 4096 + 2 * 4096  # y and x read, the result written
  assert 2 * 4096 <= cheapest < 2 * 4096 + 64


def test_shape_bytes_packs_sub_byte_types_and_sums_tuples():
  assert _hlo.shape_bytes('(bf16[8,128]{1,0}, s4[3]{0}, pred[])') == 8 * 128 * 2 + 2 + 1


# Lines as the compilers wrote them (shortened): a Mosaic kernel named after its Pallas
# function, a Triton kernel whose name is in its op name, a jitted wrapper's Triton kernel,
# XLA's Triton GEMM fusion, a cuBLAS call and the CPU kernel's call.
TPU_LINE = ('  %splash_mqa_fwd_no_residuals.1 = (f32[2,128,128]{2,1,0}) custom-call(%constant.65), '
            'custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/splash"}')
GPU_LINE = ('  %pallas_call.4 = (f32[8,1,2,2,128]{4,3,2,1,0}) custom-call(%p.1), '
            'custom_call_target="__gpu$xla.gpu.triton", '
            'metadata={op_name="jit(run)/qjax_paged_attention_triton/pallas_call"}')
QMM_LINE = ('  ROOT %pallas_call = f32[16,512]{1,0} custom-call(%x), '
            'custom_call_target="__gpu$xla.gpu.triton", '
            'metadata={op_name="jit(run)/jit(_qmm)/pallas_call"}')
GEMM_LINE = ('  %gemm_fusion = bf16[8,512]{1,0} fusion(%a, %b), kind=kCustom, calls=%c, '
             'backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}')
CUBLAS_LINE = ('  %cublas-gemm.1 = (bf16[8,512]{1,0}) custom-call(%a, %b), '
               'custom_call_target="__cublas$gemm"')
CPU_LINE = '  %cc = f32[1,512]{1,0} custom-call(%x, %w), custom_call_target="qjax_gemv_kn_int8"'
MODULE = '\n'.join([TPU_LINE, GPU_LINE, QMM_LINE, GEMM_LINE, CUBLAS_LINE, CPU_LINE])


def test_custom_calls_count_targets_and_triton_gemm_fusions():
  assert _hlo.custom_calls(MODULE) == {
      'tpu_custom_call': 1, '__gpu$xla.gpu.triton': 2, '__triton_nested_gemm_fusion': 1,
      '__cublas$gemm': 1, 'qjax_gemv_kn_int8': 1}


def test_kernel_families_name_each_family_present_once():
  assert _hlo.kernel_families(_hlo.custom_calls(MODULE)) == [
      'mosaic', 'triton', 'cublas', 'qjax_cpu_kernel']
  assert _hlo.kernel_families({'__cudnn$fmhaSoftmax': 1}) == ['cudnn']
  assert _hlo.kernel_families({}) == []


def test_kernel_names_come_from_the_instruction_or_the_op_name():
  assert _hlo.kernel_names(MODULE) == {'splash_mqa_fwd_no_residuals': 1,
                                       'qjax_paged_attention_triton': 1, '_qmm': 1}
  assert _hlo.kernel_names(GEMM_LINE + '\n' + CUBLAS_LINE) == {}


def test_collective_counts_on_a_sharded_cpu_module():
  """Over the 8 simulated CPU devices tests/conftest.py sets up."""
  mesh = Mesh(np.array(jax.devices()[:8]), ('x',))
  split = NamedSharding(mesh, PartitionSpec('x'))
  summed = _text(jnp.sum, F32_1024, in_shardings=split)
  assert _hlo.collective_counts(summed) == {'all-reduce': 1}
  gathered = _text(lambda a: a, F32_1024, in_shardings=split,
                   out_shardings=NamedSharding(mesh, PartitionSpec()))
  assert _hlo.collective_counts(gathered) == {'all-gather': 1}
  assert _hlo.collective_counts(_text(lambda x: x * 2, F32_1024)) == {}
