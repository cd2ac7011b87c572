"""The compiler's prediction for a program the device check times, from the very executable
it runs.

`greedy_step_program` and `decode_steps_program` lower the jitted function behind
`generate.greedy_step` / `generate.decode_steps` with the arguments those calls pass (the
row has just run them, so jax serves the compile from its in-memory cache: no executable is
added; the check counts the compiles to show it). `prediction` reads XLA's figures of a
compiled program: bytes accessed, flops, temp bytes and, on a chip in `qjax.costmodel`'s
table, the roofline time (`qjax.aot.analyze`: max(bytes / HBM bandwidth, flops / peak)).
These are the compiler's predictions, never measurements.

A custom call (qjax's CPU kernel, a Pallas kernel) is opaque to XLA's cost analysis: its
work is missing from 'bytes accessed' and 'flops' (W8A8's decode step on the CPU kernel reports
a tenth of bf16's bytes), so each prediction also carries `custom_calls` and `hlo_bytes`
(`qjax.aot.bytes_moved`: every op's operands and result, custom calls included).

XLA's cost analysis counts a `while` body once when the trip count is not known at compile
time (the decode loops stop rows early, so it never is): a loop program's figures are one
step's, the per-step prediction the loop's ms per step is set beside.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from qjax import aot
from qjax.nn import generate
from qjax.nn.decode_core import LoopState
from qjax.nn.model_split import split_for_decode


def _cost(compiled) -> dict:
  try:
    cost = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except  (a backend without one)
    return {}
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return dict(cost or {})


def prediction(compiled, program: str, chip: Optional[str], compute_bits: int = 16) -> dict:
  """The compiler's figures for `compiled` (a `jax.stages.Compiled`): bytes accessed, flops,
  temp bytes, and the roofline in ms on `chip` (a costmodel preset; None: no roofline)."""
  if chip is not None:
    r = aot.analyze(compiled, program=program, chip=chip, compute_bits=compute_bits)
    return {'program': program, 'chip': chip, 'bytes_accessed': r.bytes_accessed,
            'bytes_source': r.bytes_source, 'flops': r.flops, 'temp_bytes': r.temp_bytes,
            'hlo_bytes': r.hlo_bytes, 'custom_calls': r.custom_calls,
            'roofline_ms': None if r.roofline_s is None else 1e3 * r.roofline_s}
  cost, mem, text = _cost(compiled), compiled.memory_analysis(), compiled.as_text()
  hlo_bytes = aot.bytes_moved(text)
  if 'bytes accessed' in cost:
    bytes_, source = float(cost['bytes accessed']), 'xla cost analysis'
  else:
    bytes_, source = float(hlo_bytes), 'hlo ops (upper bound)'
  return {'program': program, 'chip': None, 'bytes_accessed': bytes_, 'bytes_source': source,
          'flops': float(cost['flops']) if 'flops' in cost else None,
          'temp_bytes': None if mem is None else int(mem.temp_size_in_bytes),
          'hlo_bytes': hlo_bytes, 'custom_calls': aot.custom_calls(text), 'roofline_ms': None}


def ratio(measured_ms: Optional[float], predicted: Optional[dict]) -> Optional[float]:
  """measured / predicted roofline ms (None where either is missing)."""
  roof = (predicted or {}).get('roofline_ms')
  return measured_ms / roof if measured_ms and roof else None


def greedy_step_program(model, tokens_BT, cache):
  """The executable `generate.greedy_step(model, tokens_BT, cache)` runs (T a power of two
  that fits the cache, so the call pads nothing)."""
  static, state = split_for_decode(model)
  tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
  num_real = np.int32(tokens_BT.shape[1])
  return generate._greedy_step.lower(  # pylint: disable=protected-access
      static, state, tokens_BT, num_real, cache).compile()


def decode_steps_program(model, tok_B, cache, num_steps: int):
  """The executable `generate.decode_steps(model, tok_B, cache, num_steps)` runs."""
  static, state = split_for_decode(model)
  tok_B = jnp.asarray(tok_B, jnp.int32)
  loop = LoopState(tok_B, jnp.zeros(tok_B.shape, jnp.int32),
                   jnp.full(tok_B.shape, num_steps, jnp.int32),
                   jnp.full(tok_B.shape + (1,), -1, jnp.int32), tok_B >= 0, ())
  return generate._loop_block.lower(  # pylint: disable=protected-access
      static, state, cache, loop, generate.greedy_pick,
      generate.bucket_length(num_steps)).compile()


def abstract(tree):
  """`tree` with every array a ShapeDtypeStruct of its shape, dtype, sharding and weak type
  (what lowering reads; a donated buffer is gone after its call, its shape is not)."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                     weak_type=x.weak_type)
      if isinstance(x, jax.Array) else x, tree)
