"""`choose`: the one place the quantized matmul's path is decided, from one table.

A call's facts (`Call`: weight format and groups, activation format, rows, spec) and the target
(`qjax.target`: the devices the program is compiled for, not the host's backend) pick the
implementation. `path='auto'` walks the target's row of `AUTO`; a named path walks its own
candidates (`NAMED`), so it either runs what it names or says which documented fallback ran
instead and why. Every choice is a `Choice(path, reason)`; a fallback is logged once per
process and distinct reason. The path modules never read the target: `run` hands it to them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

from qjax import target as qjax_target
from qjax.core.paths import (cpu_head_blocks, cpu_kernel, cpu_tiles, dequant, int_dot, native,
                             pallas_gpu, pallas_tpu)
from qjax.core.paths.call import Call

_LOG = logging.getLogger('qjax.core.paths')

MODULES = {m.NAME: m for m in (cpu_kernel, cpu_tiles, cpu_head_blocks, native, pallas_tpu,
                               pallas_gpu, int_dot, dequant)}
IMPLEMENTATIONS = tuple(MODULES)

# path='auto': the implementations tried in order, per target platform and activations
# ('float': weight-only; 'quantized': int8 / fp8 activations, W8A8 and fp8 x fp8).
AUTO = {
    ('cpu', 'float'): ('kernel', 'tiled', 'vblocks', 'dequant'),
    ('cpu', 'quantized'): ('kernel', 'tiled', 'vblocks', 'int_dot', 'dequant'),
    ('tpu', 'float'): ('pallas_tpu', 'native', 'dequant'),
    ('tpu', 'quantized'): ('int_dot', 'dequant'),
    ('nvidia', 'float'): ('native', 'dequant'),
    ('nvidia', 'quantized'): ('int_dot', 'dequant'),
    ('rocm', 'float'): ('native', 'dequant'),
    ('rocm', 'quantized'): ('int_dot', 'dequant'),
}
# NVIDIA, weight-only, grouped or int4 codes: the Triton kernels go first where they fit (the
# projections at any number of rows, the tied head at decode rows). XLA:GPU writes a grouped
# weight dequantized unless the subchannel dequantisation fusion flag is set (process-wide: a
# traced function cannot set it), and on a compile-only H200 it converted per-channel int4
# gate and up weights to bf16 (at batch 8, and at a 512-token prefill) to fuse their two dots
# into one GEMM (docs/quantized_matmul.md).
AUTO_NVIDIA_KERNEL_FIRST = ('pallas_gpu', 'native', 'dequant')

# A named path: what it may run, in order: itself, then the fallbacks its docs promise.
NAMED = {
    'dequant': ('dequant',),
    'tiled': ('tiled', 'vblocks', 'dequant'),
    'kernel': ('kernel',),
    'native': ('native',),
    'pallas_tpu': ('pallas_tpu',),
    'pallas_gpu': ('pallas_gpu',),
}
# What each request means to run; anything else it runs is a fallback (logged once).
PRIMARY = {
    'auto': tuple(n for n in MODULES if n != 'dequant'),
    'tiled': ('tiled', 'vblocks'),
    'int8': ('kernel', 'tiled', 'vblocks', 'int_dot'),
    'fp8': ('tiled', 'int_dot'),
    'pallas': ('pallas_tpu', 'pallas_gpu'),
}
REQUESTS = ('auto', 'dequant', 'tiled', 'kernel', 'int8', 'fp8', 'native', 'pallas',
            'pallas_tpu', 'pallas_gpu')
WEIGHT_ONLY_REQUESTS = ('native', 'pallas', 'pallas_tpu', 'pallas_gpu')


@dataclasses.dataclass(frozen=True)
class Choice:
  """The implementation a call runs, and why.

  Attributes:
    path: an implementation (`IMPLEMENTATIONS`).
    reason: why: the request and target, and why each candidate before it did not fit.
    request: the `path=` asked for ('auto' or a name).
    fallback: a named request ran something other than its first candidate.
  """

  path: str
  reason: str
  request: str = 'auto'
  fallback: bool = False

  def to_dict(self) -> dict:
    return {'path': self.path, 'reason': self.reason}


def _activations(call: Call) -> str:
  return 'float' if call.act is None else 'quantized'


def candidates(call: Call, request: str, target) -> tuple[str, ...]:
  """The implementations `request` may run for this call on `target`, in order."""
  platform = target.platform
  if request == 'auto':
    key = (platform if platform in ('cpu', 'tpu', 'nvidia', 'rocm') else 'nvidia',
           _activations(call))
    if key == ('nvidia', 'float') and (not call.per_channel or call.qtype.bits == 4):
      return AUTO_NVIDIA_KERNEL_FIRST
    return AUTO[key]
  if request in ('int8', 'fp8'):
    key = (platform if platform in ('cpu', 'tpu', 'nvidia', 'rocm') else 'nvidia', 'quantized')
    return AUTO[key]
  if request == 'pallas':
    kernel = 'pallas_tpu' if platform == 'tpu' else 'pallas_gpu'
    rest = AUTO.get((platform, 'float'), AUTO[('nvidia', 'float')])
    return (kernel,) + tuple(p for p in rest if p not in ('kernel', kernel, 'pallas_gpu'))
  return NAMED[request]


def check_request(call: Call, request: str) -> None:
  """Raise for a request that cannot fit the call whatever the target (mismatched kinds, a
  weight-only path with quantized activations)."""
  if request not in REQUESTS:
    raise ValueError(f'qeinsum: path={request!r} is unknown; use one of {REQUESTS}.')
  if request in WEIGHT_ONLY_REQUESTS and call.act is not None:
    kind = 'fp8' if call.act != 'int' else 'int8'
    raise ValueError(f'qeinsum: path={request!r} is weight-only, but act_fmt asks for {kind} '
                     f"activations; use path='auto' (or '{kind}'), or drop act_fmt.")
  if request in ('int8', 'fp8') and (request == 'int8') == call.qtype.is_float:
    raise ValueError(f'qeinsum: path={request!r} cannot multiply {call.qtype.name} weights; '
                     f"use path='{'fp8' if call.qtype.is_float else 'int8'}' or 'dequant'.")


def choose(call: Call, request: str = 'auto', target=None) -> Choice:
  """The implementation `qeinsum(path=request)` runs for `call` on `target`, and why.

  Args:
    call: the call's facts (`Call.of(spec, x, w, act)`).
    request: the `path=` asked for: 'auto' or a name in `REQUESTS`.
    target: a `qjax.target.Target` (default: `qjax.target.current()`).

  Returns:
    A Choice.

  Raises:
    ValueError: an unknown or mismatched request, or a named path with no fallback that
      cannot run this call (the message names why and what would).
  """
  check_request(call, request)
  target = target or qjax_target.current()
  tried = []
  names = candidates(call, request, target)
  for name in names:
    why = MODULES[name].fits(call, target, asked=request == name)
    if why is None:
      fallback = name not in PRIMARY.get(request, (request,))
      return _choice(call, request, target, name, tried, fallback)
    tried.append(f'{name}: {why}')
  raise ValueError(f"qeinsum: path={request!r} cannot run {call.spec} with a "
                   f"{call.weight_name} weight on {target.platform} ({'; '.join(tried)}); use "
                   "path='auto'.")


def _choice(call: Call, request: str, target, name: str, tried: list,
            fallback: bool) -> Choice:
  where = f'{target.platform} ({target.device_kind})'
  head = (f'auto on {where}, {call.bucket} ({call.rows} rows)' if request == 'auto' else
          f'{request!r} asked on {where}')
  reason = head + (': ' + '; '.join(tried) if tried else '') + f' -> {name}'
  choice = Choice(name, reason, request, fallback)
  if fallback:
    _log_once(f'qeinsum: {call.spec} with a {call.weight_name} weight: {reason}')
  return choice


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
  """Log a fallback once per process and message (the cache is the set of messages seen)."""
  _LOG.warning(message)


def run(choice: Choice, call: Call, x, w, out_dtype, target=None):
  """Run `call` on the implementation `choice` names."""
  target = target or qjax_target.current()
  return MODULES[choice.path].run(call, x, w, out_dtype, target=target,
                                  asked=choice.request == choice.path)


def family(w_qtype, act_fmt, target) -> str:
  """The path family 'auto' takes for this code type and activation format on `target`
  before any shape is known (`qjax.core.choose_path`): 'int8' / 'fp8' with quantized
  activations; on CPU 'tiled' (the kernel, row tiles or V blocks by shape); elsewhere
  'native' for codes XLA reads as stored, 'dequant' for hand-packed 2/3/4-bit codes."""
  if act_fmt is not None:
    if w_qtype.is_float != act_fmt.is_float:
      raise ValueError(f'qeinsum: weights {w_qtype.name} and activations {act_fmt.name} mix '
                       'integer and float codes; use both int or both fp8.')
    return 'fp8' if act_fmt.is_float else 'int8'
  if target.platform == 'cpu':
    return 'tiled'
  return 'dequant' if w_qtype.packed else 'native'
