"""Compile qjax programs for a TPU or GPU this machine does not have, and read what the
compiler predicts: memory per device, bytes and flops, the kernels present.

  report = qjax.aot.compile_for(step, state_shapes, tokens_shape, target='v5e-1')
  report.compiled, report.peak_bytes, report.fits, report.kernels, report.roofline_s

The compile-only toolchains (libtpu, the CUDA plugin) live in a folder of their own:
`python -m qjax.aot.install` installs them (`qjax.aot.toolchain`). While a program is
traced for a target, `qjax.target` names that target's devices, so every path decision in
qjax is the one it would make on that TPU or GPU.
"""

from qjax.aot import _programs as programs
from qjax.aot import toolchain
from qjax.aot._compile import Report, abstract_args, analyze, compile_for, tracing_for
from qjax.aot._hlo import bytes_moved, custom_calls, kernel_families
from qjax.aot._targets import TARGETS, TargetSpec, devices, gpu_target_config, mesh, spec_of
from qjax.aot._targets import target

__all__ = ['Report', 'TARGETS', 'TargetSpec', 'abstract_args', 'analyze', 'bytes_moved',
           'compile_for', 'custom_calls', 'devices', 'gpu_target_config', 'kernel_families',
           'mesh', 'programs', 'spec_of', 'target', 'toolchain', 'tracing_for']
