"""A synthetic serving workload and one timed run of it through an `Engine`.

    prompts, params = synthetic_workload(num_requests=32, vocab_size=256, ...)
    row = serve(engine, prompts, params)   # throughput, waste, prefix hits, compilations

`experiments/serve.py` and the engine notebook print these rows; they live here so that a
test can run them.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np

from qjax.infer.engine import Engine
from qjax.infer.engine_config import EngineStats
from qjax.infer.sampling import SamplingParams


def synthetic_workload(*, num_requests: int, vocab_size: int, prompt_len: tuple[int, int],
                       output_len: tuple[int, int], system_len: int = 0,
                       shared_fraction: float = 0.0,
                       seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
  """Prompts and greedy sampling parameters drawn from a stated distribution.

  Args:
    num_requests: how many requests.
    vocab_size: token ids are uniform in [0, vocab_size).
    prompt_len: (lo, hi): each prompt's own length, uniform in [lo, hi].
    output_len: (lo, hi): each request's max_tokens, uniform in [lo, hi].
    system_len: length of a common system prompt.
    shared_fraction: share of requests whose prompt starts with the system prompt.
    seed: the draw's seed.

  Returns:
    (prompts, params), one SamplingParams(temperature=0, max_tokens=...) per prompt.
  """
  if not 0 <= shared_fraction <= 1:
    raise ValueError(f'synthetic_workload: shared_fraction={shared_fraction} must be in [0, 1].')
  rng = np.random.default_rng(seed)
  system = rng.integers(0, vocab_size, system_len).tolist()
  prompts, params = [], []
  for _ in range(num_requests):
    own = rng.integers(0, vocab_size, int(rng.integers(prompt_len[0], prompt_len[1] + 1)))
    shared = rng.random() < shared_fraction
    prompts.append((system if shared else []) + own.tolist())
    n = int(rng.integers(output_len[0], output_len[1] + 1))
    params.append(SamplingParams(temperature=0.0, max_tokens=n))
  return prompts, params


def serve(engine: Engine, prompts: Sequence[Sequence[int]],
          params: Sequence[SamplingParams]) -> dict:
  """Run the workload to completion; measured numbers of this run (wall clock included).

  Returns:
    dict: requests, generated tokens, seconds, tokens_per_s, steps, dispatches,
    prefill_tokens, prefix_hit_tokens, preemptions, compilations, paged_waste,
    contiguous_waste, and this run's host / dispatch / device-wait ms per step and host
    share (`EngineStats.timing`).
  """
  st0 = dataclasses.replace(engine.stats)
  before = engine.stats.steps
  t0 = time.perf_counter()
  outs = engine.generate(list(prompts), list(params))
  seconds = time.perf_counter() - t0
  st = engine.stats
  generated = sum(len(o) for o in outs)
  return dict(requests=len(outs), generated=generated, seconds=round(seconds, 3),
              tokens_per_s=round(generated / seconds, 1), steps=st.steps - before,
              prefill_tokens=st.prefill_tokens, prefix_hit_tokens=st.prefix_hit_tokens,
              preemptions=st.preemptions, compilations=st.compilations,
              paged_waste=round(st.paged_waste, 4),
              contiguous_waste=round(st.contiguous_waste, 4), **run_timing(st0, st))


def run_timing(before: EngineStats, after: EngineStats) -> dict:
  """`EngineStats.timing` of the steps between two snapshots of one engine's stats."""
  delta = EngineStats(**{f: getattr(after, f) - getattr(before, f)
                         for f in ('steps', 'dispatches', 'host_s', 'dispatch_s', 'wait_s',
                                   'compile_s')})
  return {k: round(v, 4) if isinstance(v, float) else v for k, v in delta.timing().items()
          if k != 'steps'}
