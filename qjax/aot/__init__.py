"""Compile qjax programs for a TPU or GPU this machine does not have, and read what the
compiler predicts: memory per device, bytes and flops, the kernels present.

  report = qjax.aot.compile_for(step, state_shapes, tokens_shape, target='v5e-1')
  report.compiled, report.peak_bytes, report.fits, report.kernels, report.roofline_s

The compile-only toolchains (libtpu, the CUDA plugin) live in a folder of their own:
`python -m qjax.aot.install` installs them (`qjax.aot.toolchain`). While a program is
traced for a target, `qjax.target` names that target's devices, so every path decision in
qjax is the one it would make on that TPU or GPU.

Pope et al.'s layouts on a TPU pod slice (`qjax.sharding`'s rules, compiled by the TPU
compiler for a slice's compile-only chips):

  rows = qjax.aot.compare_layouts('llama3_8b', 'v5e:2x4', workload, 'decode')
  qjax.aot.compile_step(model, 'v4:4x4x4', '2d_ws+mq_batch', workload, 'decode')
"""

from qjax.aot import _programs as programs
from qjax.aot import toolchain
from qjax.aot._compile import (Report, abstract_args, analyze, compile_for, roofline,
                               roofline_bytes, tracing_for)
from qjax.aot._hbm import hbm_traffic
from qjax.aot._hlo import bytes_moved, custom_calls, kernel_families
from qjax.aot._targets import TARGETS, TargetSpec, devices, gpu_target_config, mesh, spec_of
from qjax.aot._targets import target
from qjax.aot._layout_compare import (Comparison, NotCompiled, best_agrees, best_meshes, compare,
                                      compare_layouts, format_rows)
from qjax.aot._layout_compare import compiled as compiled_rows
from qjax.aot._layout_compile import CompiledStep, compile_step, compiled_shape, model_config
from qjax.aot._slices import Slice, parse_slice, slice_devices, slice_mesh
from qjax.aot._train_compile import TrainStep, compile_train_step

__all__ = ['CompiledStep', 'Comparison', 'NotCompiled', 'Report', 'Slice', 'TARGETS',
           'TargetSpec', 'TrainStep', 'abstract_args', 'analyze', 'best_agrees', 'best_meshes',
           'bytes_moved', 'compare', 'compare_layouts', 'compile_for', 'compile_step',
           'compile_train_step', 'compiled_rows', 'compiled_shape', 'custom_calls', 'devices',
           'format_rows', 'gpu_target_config', 'hbm_traffic', 'kernel_families', 'mesh',
           'model_config', 'parse_slice', 'programs', 'roofline', 'roofline_bytes', 'slice_devices',
           'slice_mesh', 'spec_of', 'target', 'toolchain', 'tracing_for']
