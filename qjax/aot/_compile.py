"""Compile a function for a named target from abstract arguments, and report what the
compiler says about it: memory per device, bytes, flops, kernels, and a roofline time.

Every figure in a `Report` is the compiler's prediction for a device this machine does not
have; nothing here runs a program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, Callable, Optional

import jax
import numpy as np

from qjax import costmodel
from qjax import target as qjax_target
from qjax.aot import _hbm, _hlo
from qjax.aot import _targets
from qjax.aot import toolchain

_LOG = logging.getLogger('qjax.aot')


@dataclasses.dataclass
class Report:
  """What compiling one program for one target gave (all per device; all predictions).

  Attributes:
    program: the program's name.
    target: the target's name ('v5e-1', 'h200', ...).
    device_kind: the compile-only device's kind.
    compiled: whether the compiler accepted the program.
    error: the compiler's (or tracer's) error where it did not, else None.
    argument_bytes, output_bytes, alias_bytes, temp_bytes, generated_code_bytes:
      `compiled.memory_analysis()`, per device.
    peak_bytes: arguments + outputs - aliased + temp: what one device holds while it runs.
    hbm_bytes: one device's HBM (`qjax.costmodel` chip table).
    fits: peak_bytes <= hbm_bytes.
    flops: XLA's cost analysis, or None where the compiler gives none (GPU).
    bytes_accessed: XLA's cost analysis 'bytes accessed' where given, else the module's
      `_hlo.bytes_moved` count; `bytes_source` says which.
    hlo_bytes: `_hlo.bytes_moved` (the same rule on every target).
    hbm_traffic: the bytes one device reads from and writes to HBM, counted from the compiled
      HLO (`qjax.aot.hbm_traffic`): each transfer once, where XLA:TPU's 'bytes accessed'
      counts a weight prefetched into VMEM several times. The roofline's bytes.
    vmem_prefetch_bytes: bytes XLA:TPU copies into VMEM ahead of their use (0 on a GPU).
    custom_calls: {custom-call target: count} in the compiled module.
    kernels: kernel families present ('mosaic', 'triton', 'cudnn', 'cublas', ...).
    kernel_names: {name: count} of the Pallas / Mosaic / Triton kernels called
      ('splash_mqa_fwd_no_residuals', 'qjax_paged_attention_mosaic', ...).
    collectives: {kind: count} of collective ops in the module.
    compile_s: seconds the lowering and compilation took here.
    roofline_s: max(HBM traffic over HBM bandwidth, flops over peak) on the chip's datasheet
      (a lower bound on a step's time); XLA's bytes accessed where the traffic is not known.
    estimate_s: the cost model's time for the same step where the caller gave one.
    toolchain: the compile-only toolchain's versions (its manifest).
  """

  program: str
  target: str
  device_kind: Optional[str] = None
  compiled: bool = False
  error: Optional[str] = None
  argument_bytes: Optional[int] = None
  output_bytes: Optional[int] = None
  alias_bytes: Optional[int] = None
  temp_bytes: Optional[int] = None
  generated_code_bytes: Optional[int] = None
  peak_bytes: Optional[int] = None
  hbm_bytes: Optional[float] = None
  fits: Optional[bool] = None
  flops: Optional[float] = None
  bytes_accessed: Optional[float] = None
  bytes_source: Optional[str] = None
  hlo_bytes: Optional[int] = None
  hbm_traffic: Optional[int] = None
  vmem_prefetch_bytes: Optional[int] = None
  custom_calls: dict = dataclasses.field(default_factory=dict)
  kernels: list = dataclasses.field(default_factory=list)
  kernel_names: dict = dataclasses.field(default_factory=dict)
  collectives: dict = dataclasses.field(default_factory=dict)
  compile_s: Optional[float] = None
  roofline_s: Optional[float] = None
  estimate_s: Optional[float] = None
  toolchain: Optional[dict] = None

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def _cost(compiled) -> dict:
  try:
    cost = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except  (some clients have none)
    return {}
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return dict(cost or {})


def _abstract(x, sharding):
  """A ShapeDtypeStruct of an argument leaf placed by `sharding` where it has none here."""
  if isinstance(x, jax.ShapeDtypeStruct):
    keep = isinstance(x.sharding, jax.sharding.NamedSharding)
    return x if keep else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  if isinstance(x, (jax.Array, np.ndarray, np.generic)):
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)
  return x


def abstract_args(args, mesh: jax.sharding.Mesh):
  """`args` as ShapeDtypeStructs on `mesh`: leaves with a NamedSharding keep it (it must be
  over the target's mesh), every other array is replicated."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.tree.map(lambda x: _abstract(x, replicated), args)


@contextlib.contextmanager
def tracing_for(name: str):
  """Trace as for target `name`: `qjax.target` and jax's default device are its devices.

  Yields:
    (the Mesh of the target's devices, the qjax.target.Target).
  """
  mesh = _targets.mesh(name)
  t = _targets.target(name)
  with qjax_target.use(t), jax.default_device(mesh.devices.flat[0]):
    yield mesh, t


def roofline(spec, flops: Optional[float], bytes_: Optional[float],
             compute_bits: float) -> Optional[float]:
  """max(bytes over the HBM bandwidth, flops over the peak) of one device of target `spec`."""
  if bytes_ is None:
    return None
  chip = costmodel.get_chip(spec.chip)
  # A device of a multi-core chip gets its share of the chip's bandwidth and peak.
  bw = chip.hbm_bw / spec.devices_per_chip
  peak = chip.peak_flops(compute_bits) / spec.devices_per_chip
  return max(bytes_ / bw, (flops or 0.0) / peak)


def compile_for(fn: Callable, *args: Any, target: str, program: Optional[str] = None,
                static_argnums=(), donate_argnums=(), compute_bits: float = 16,
                estimate_s: Optional[float] = None,
                compiler_options: Optional[dict] = None) -> Report:
  """Compile `fn(*args)` for a named target and report what the compiler said.

  No weights are materialised: pass ShapeDtypeStructs (`jax.eval_shape`, `nnx.eval_shape`)
  or arrays (only their shapes are read). Leaves sharded with a NamedSharding over
  `qjax.aot.mesh(target)` keep it; others are replicated over the target's devices.

  Args:
    fn: the function (jitted here; a `jax.jit`-wrapped one is fine).
    *args: its arguments, abstract or concrete.
    target: a name from `qjax.aot.TARGETS`.
    program: the report's name for it (default: fn's name).
    static_argnums, donate_argnums: as `jax.jit`.
    compute_bits: matmul operand width for the roofline's peak (16, or 8 for int8/fp8 dots).
    estimate_s: the cost model's time for the same step, carried into the report.
    compiler_options: XLA options for this compile (e.g.
      {'xla_gpu_experimental_enable_subchannel_dequantisation_fusion': True}).

  Returns:
    A Report; `compiled` is False and `error` holds the compiler's message where it refused.

  Raises:
    RuntimeError: the target's toolchain is not installed (how to install it named).
  """
  spec = _targets.spec_of(target)
  program = program or getattr(fn, '__name__', 'program')
  report = Report(program=program, target=spec.name, hbm_bytes=spec.hbm_per_device,
                  estimate_s=estimate_s, toolchain=toolchain.read_manifest())
  t0 = time.perf_counter()
  with tracing_for(spec.name) as (mesh, t):
    report.device_kind = t.device_kind
    try:
      lowered = jax.jit(fn, static_argnums=static_argnums,
                        donate_argnums=donate_argnums).lower(*abstract_args(args, mesh))
      compiled = lowered.compile(compiler_options) if compiler_options else lowered.compile()
    except Exception as e:  # pylint: disable=broad-except  (the compiler's refusal is the result)
      report.error = f'{type(e).__name__}: {e}'
      report.compile_s = time.perf_counter() - t0
      _LOG.info('qjax.aot: %s did not compile for %s: %s', program, spec.name, report.error)
      return report
  report.compile_s = time.perf_counter() - t0
  report.compiled = True
  _fill(report, compiled, spec, compute_bits)
  return report


def analyze(compiled, *, program: str, chip: str, devices_per_chip: int = 1,
            compute_bits: float = 16, estimate_s: Optional[float] = None) -> Report:
  """The Report of a program already compiled (on a real device too): the same figures
  `compile_for` gives, with the roofline on `chip` (a `qjax.costmodel` preset), so a timed
  row can be printed beside the compiler's prediction for it.

  Args:
    compiled: a `jax.stages.Compiled` (`jax.jit(f).lower(...).compile()`).
    program: the report's name for it.
    chip: the costmodel chip preset of the device it was compiled for ('h200', 'tpu_v5e').
    devices_per_chip: jax devices per chip (2 on TPU v4).
    compute_bits: matmul operand width for the roofline's peak.
    estimate_s: the cost model's time for the same step, carried into the report.
  """
  spec = _targets.TargetSpec(chip, 'device', chip, chip, devices_per_chip=devices_per_chip)
  report = Report(program=program, target=chip, hbm_bytes=spec.hbm_per_device, compiled=True,
                  estimate_s=estimate_s)
  _fill(report, compiled, spec, compute_bits)
  return report


def _fill(report: Report, compiled, spec, compute_bits: float) -> None:
  """The memory, cost and HLO figures of a compiled program."""
  mem = compiled.memory_analysis()
  if mem is not None:
    report.argument_bytes = int(mem.argument_size_in_bytes)
    report.output_bytes = int(mem.output_size_in_bytes)
    report.alias_bytes = int(mem.alias_size_in_bytes)
    report.temp_bytes = int(mem.temp_size_in_bytes)
    report.generated_code_bytes = int(mem.generated_code_size_in_bytes)
    report.peak_bytes = (report.argument_bytes + report.output_bytes - report.alias_bytes +
                         report.temp_bytes)
    report.fits = report.peak_bytes <= report.hbm_bytes
  text = compiled.as_text()
  report.custom_calls = _hlo.custom_calls(text)
  report.kernels = _hlo.kernel_families(report.custom_calls)
  report.kernel_names = _hlo.kernel_names(text)
  report.collectives = _hlo.collective_counts(text)
  report.hlo_bytes = _hlo.bytes_moved(text)
  traffic = _hbm.hbm_traffic(text)
  report.hbm_traffic, report.vmem_prefetch_bytes = traffic['hbm'], traffic['vmem_prefetch']
  cost = _cost(compiled)
  report.flops = float(cost['flops']) if 'flops' in cost else None
  if 'bytes accessed' in cost:
    report.bytes_accessed, report.bytes_source = float(cost['bytes accessed']), 'xla cost analysis'
  else:
    report.bytes_accessed, report.bytes_source = float(report.hlo_bytes), 'hlo ops (upper bound)'
  report.roofline_s = roofline(spec, report.flops, roofline_bytes(report), compute_bits)


def roofline_bytes(report: Report) -> Optional[float]:
  """The bytes a report's roofline reads: its HBM traffic, else XLA's bytes accessed."""
  return report.bytes_accessed if report.hbm_traffic is None else float(report.hbm_traffic)
