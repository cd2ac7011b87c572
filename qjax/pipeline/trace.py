"""A request trace (Poisson arrivals) replayed through an `Engine`, with latency percentiles.

    trace = poisson_trace(num_requests=24, rate=2.0, prompt_len=(8, 48), output_len=(8, 32),
                          system_prompt=sys_ids, shared_fraction=0.5, vocab_size=256)
    result = replay(engine, trace)                 # continuous batching
    result = replay(engine, trace, static=True)    # static batches (pad, run to the longest)
    result['ttft_p50'], result['itl_p99'], result['tokens_per_s'], result['prefix_hit_rate']

The clock: arrivals are seconds from the first one. The replay never sleeps: when the engine
is idle it jumps to the next arrival; otherwise it advances by the measured wall time of each
step (scheduling, the jitted step and its host copy). So every latency is what a real-time
server with this engine would have shown, minus only the host time between steps that a
real server would spend on its network. A request's tokens are stamped when the step that
made them returns.

Static batching is emulated on the same engine and step executables, the way HF `generate`
batches: when the engine is idle, up to `max_batch` requests that have arrived start
together, every prompt left-padded (with `pad_id`) to the batch's longest and every request
run to the batch's longest `max_tokens`; nothing joins until the whole batch is done.
Tokens past a request's own `max_tokens` are computed and thrown away. The padding is
attended (no mask), so a padded request's tokens are not its unpadded ones: the emulation
reproduces the cost of static batching, not its outputs.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Optional, Sequence

import jax
import numpy as np

from qjax.infer.engine import Engine
from qjax.infer.sampling import SamplingParams

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass(frozen=True)
class TraceRequest:
  """One request of a trace: arrival (seconds), prompt ids, max tokens, system-prompt flag."""
  id: str
  arrival: float
  prompt: tuple[int, ...]
  max_tokens: int
  shared: bool


def poisson_trace(*, num_requests: int, rate: float, prompt_len: tuple[int, int],
                  output_len: tuple[int, int], system_prompt: Sequence[int] = (),
                  shared_fraction: float = 0.0, vocab_size: Optional[int] = None,
                  token_source: Optional[Sequence[int]] = None, bos: Optional[int] = None,
                  output_dist: str = 'uniform', seed: int = 0) -> list[TraceRequest]:
  """Requests with exponential inter-arrival times (a Poisson process of `rate` per second).

  Args:
    num_requests: how many requests; the first arrives at 0.
    rate: mean arrivals per second (> 0).
    prompt_len: (lo, hi): each request's own prompt length, uniform in [lo, hi].
    output_len: (lo, hi): each request's max_tokens in [lo, hi], drawn by `output_dist`.
    system_prompt: token ids a share of the prompts start with.
    shared_fraction: that share, in [0, 1] (each request independently).
    vocab_size: own prompt ids uniform in [0, vocab_size) (when no `token_source`).
    token_source: a token-id sequence (a tokenized corpus); own prompts are windows of it
      at uniform offsets.
    bos: a token every prompt starts with (before the system prompt), or None.
    output_dist: 'uniform' (every length in [lo, hi] equally likely) or 'loguniform'
      (floor(exp(u)), u uniform in [log lo, log(hi + 1)): density ~ 1 / length, most outputs
      short and a long tail, as in chat traces; with (1, 64): median 8, mean 15).
    seed: the draw's seed.

  Returns:
    The requests in arrival order.
  """
  if not rate > 0:
    raise ValueError(f'poisson_trace: rate={rate} must be > 0 requests per second.')
  if not 0 <= shared_fraction <= 1:
    raise ValueError(f'poisson_trace: shared_fraction={shared_fraction} must be in [0, 1].')
  for name, (lo, hi) in (('prompt_len', prompt_len), ('output_len', output_len)):
    if not 1 <= lo <= hi:
      raise ValueError(f'poisson_trace: {name}={(lo, hi)} must satisfy 1 <= lo <= hi.')
  if (vocab_size is None) == (token_source is None):
    raise ValueError('poisson_trace: give exactly one of vocab_size= (random ids) and '
                     'token_source= (windows of a tokenized text).')
  if token_source is not None and len(token_source) <= prompt_len[1]:
    raise ValueError(f'poisson_trace: token_source has {len(token_source)} tokens, fewer '
                     f'than prompt_len[1]={prompt_len[1]} + 1.')
  if output_dist not in ('uniform', 'loguniform'):
    raise ValueError(f"poisson_trace: output_dist={output_dist!r} is unknown; use 'uniform' "
                     "or 'loguniform'.")
  rng = np.random.default_rng(seed)
  gaps = rng.exponential(1 / rate, num_requests)
  arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])])
  out = []
  for i, arrival in enumerate(arrivals):
    n = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
    if token_source is None:
      own = rng.integers(0, vocab_size, n).tolist()
    else:
      start = int(rng.integers(0, len(token_source) - n))
      own = [int(t) for t in token_source[start:start + n]]
    shared = bool(rng.random() < shared_fraction)
    lo, hi = output_len
    if output_dist == 'uniform':
      max_tokens = int(rng.integers(lo, hi + 1))
    else:
      max_tokens = min(hi, int(np.exp(rng.uniform(np.log(lo), np.log(hi + 1)))))
    out.append(TraceRequest(str(i), float(arrival),
                            tuple(([] if bos is None else [bos]) +
                                  (list(system_prompt) if shared else []) + own),
                            max_tokens, shared))
  return out


def cache_bytes(engine: Engine) -> int:
  """Device bytes of the engine's page pools (every layer, k and v, scales included)."""
  return int(sum(x.nbytes for x in jax.tree.leaves((engine.cache.k, engine.cache.v))))


def replay(engine: Engine, trace: Sequence[TraceRequest], *, static: bool = False,
           pad_id: int = 0) -> dict:
  """Serve `trace` on `engine` (greedy) on the trace clock (the module docstring).

  Args:
    engine: a fresh engine (its stats are read at the end).
    trace: requests in arrival order.
    static: static batching instead of continuous batching.
    pad_id: the left-padding token of static batches.

  Returns:
    `summarize`'s dict plus 'outputs' {request id: its tokens}.
  """
  pending = collections.deque(sorted(trace, key=lambda r: r.arrival))
  by_id = {r.id: r for r in trace}
  times: dict[str, list[float]] = {r.id: [] for r in trace}
  outputs: dict[str, list[int]] = {r.id: [] for r in trace}
  hits: dict[str, int] = {}  # prompt positions each request took from the prefix cache
  now, peak_running, busy = 0.0, 0, 0.0
  while pending or engine.scheduler.has_work:
    if not engine.scheduler.has_work and pending[0].arrival > now:
      now = pending[0].arrival  # idle: jump to the next arrival
    t0 = time.perf_counter()
    if static:
      if not engine.scheduler.has_work:
        batch = []
        while pending and pending[0].arrival <= now and len(batch) < engine.config.max_batch:
          batch.append(pending.popleft())
        longest = max(len(r.prompt) for r in batch)
        steps = max(r.max_tokens for r in batch)
        for r in batch:
          prompt = [pad_id] * (longest - len(r.prompt)) + list(r.prompt)
          engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=steps), r.id)
    else:
      while pending and pending[0].arrival <= now:
        r = pending.popleft()
        engine.add_request(list(r.prompt), SamplingParams(temperature=0.0,
                                                          max_tokens=r.max_tokens), r.id)
    events = engine.step()
    peak_running = max(peak_running, len(engine.scheduler.running) + len(
        {rid for rid, _ in events} - {s.id for s in engine.scheduler.running}))
    dt = time.perf_counter() - t0
    now += dt
    busy += dt
    for rid, tok in events:
      if len(outputs[rid]) < by_id[rid].max_tokens:  # static: the rest is thrown away
        if not outputs[rid]:  # read at the first token: a later readmission never matches
          hits[rid] = engine.prefix_hit_tokens(rid)
        outputs[rid].append(tok)
        times[rid].append(now)
  result = summarize(trace, times, engine, busy_seconds=busy, prefix_hits=hits)
  result.update(peak_running=peak_running, outputs=outputs)
  return result


def percentiles(values: Sequence[float], prefix: str) -> dict:
  """{prefix_p50: .., prefix_p90: .., prefix_p99: ..} in seconds (NaN for no values)."""
  arr = np.asarray(values, np.float64)
  return {f'{prefix}_p{q}': float(np.percentile(arr, q)) if arr.size else float('nan')
          for q in PERCENTILES}


def summarize(trace: Sequence[TraceRequest], times: dict[str, list[float]],
              engine: Optional[Engine] = None, busy_seconds: float = float('nan'),
              prefix_hits: Optional[dict[str, int]] = None) -> dict:
  """Throughput, time to first token and inter-token latency percentiles of one replay.

  Args:
    trace: the requests.
    times: per request id, the trace-clock time of each of its tokens.
    engine: the engine that served them (cache bytes, prefix hits, preemptions), or None.
    busy_seconds: time spent stepping (the rest of the span was idle).
    prefix_hits: per request id, the prompt positions it took from the prefix cache (a hit
      when > 0), or None (no prefix caching: no request hit).

  Returns:
    dict: requests, tokens, seconds (first arrival to last token), tokens_per_s,
    ttft_p50/p90/p99, itl_p50/p90/p99 (seconds), ttft_shared_mean / ttft_unshared_mean
    (requests with / without the system prompt), prefix_hit_requests and ttft_hit_mean
    (the requests that hit the prefix cache, their mean TTFT), busy_seconds,
    tokens_per_busy_s (tokens per second of stepping: the capacity when the queue never
    empties), ttft_by_request and prefix_hits ({request id: seconds / positions}), and with
    an engine: cache_bytes, prefix_hit_rate, prefix_hit_tokens, preemptions, steps,
    compilations.
  """
  missing = [r.id for r in trace if len(times[r.id]) != r.max_tokens]
  if missing:
    raise RuntimeError(f'summarize: requests {missing[:5]} did not get all their tokens.')
  ttft = {r.id: times[r.id][0] - r.arrival for r in trace}
  itl = [b - a for r in trace for a, b in zip(times[r.id], times[r.id][1:])]
  span = max(t[-1] for t in times.values()) - min(r.arrival for r in trace)
  tokens = sum(r.max_tokens for r in trace)
  mean = lambda xs: float(np.mean(xs)) if xs else float('nan')
  prefix_hits = {r.id: int((prefix_hits or {}).get(r.id, 0)) for r in trace}
  hit_ids = [rid for rid, n in prefix_hits.items() if n > 0]
  out = dict(requests=len(trace), tokens=tokens, seconds=span, tokens_per_s=tokens / span,
             **percentiles(list(ttft.values()), 'ttft'), **percentiles(itl, 'itl'),
             ttft_shared_mean=mean([ttft[r.id] for r in trace if r.shared]),
             ttft_unshared_mean=mean([ttft[r.id] for r in trace if not r.shared]),
             prefix_hit_requests=len(hit_ids), ttft_hit_mean=mean([ttft[i] for i in hit_ids]),
             ttft_by_request=ttft, prefix_hits=prefix_hits,
             busy_seconds=busy_seconds, tokens_per_busy_s=tokens / busy_seconds)
  if engine is not None:
    pc, st = engine.prefix_cache, engine.stats
    out.update(cache_bytes=cache_bytes(engine),
               prefix_hit_rate=pc.hits / max(pc.queries, 1) if pc is not None else 0.0,
               prefix_hit_tokens=st.prefix_hit_tokens, prefill_tokens=st.prefill_tokens,
               preemptions=st.preemptions, steps=st.steps, compilations=st.compilations,
               paged_waste=st.paged_waste, contiguous_waste=st.contiguous_waste)
  return out
