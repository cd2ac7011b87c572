r"""Speculative decoding inside the engine on Gemma 3 270M: SpeculativeEngine vs Engine.

    XLA_FLAGS= .venv/bin/python -m benchmarks.serve_bench [--requests=4] [--gamma=4]

The target is Gemma 3 270M (float32); the draft is the target with int4 g128 weights (the
embedding / tied head float) or its first `--skip` layers (`layer_skip_draft`). Both
engines serve the same greedy requests (Tiny Shakespeare windows) after a warm-up that
compiles their steps; printed side by side: wall seconds, target passes (steps), tokens,
whether the tokens are identical (they must be: greedy speculative decoding is greedy
decoding), alpha, tokens per round vs (1 - alpha^(gamma+1)) / (1 - alpha), and the speedup.
Expected run time: ~5-10 minutes on 2 cores (load, quantization, compilation of both).
Expected result: identical tokens; alpha ~0.7-0.8 for the int4 self-draft; little or no
  wall-clock speedup on CPU (a round costs ~gamma + 1 draft steps plus a gamma + 1 token
  verification; the draft keeps the 262k-vocabulary head), see docs/speculative.md. The
  measured run: docs/engine.md#other-measurements.
"""

from __future__ import annotations

import os
import time

from absl import app
from absl import flags

from qjax import infer
from qjax.checkpoints.gemma3 import load_gemma3_270m
from qjax.core import int_format
from qjax.data import corpus
from qjax.nn import QuantPolicy, QuantRule, quantize_model

_REQUESTS = flags.DEFINE_integer('requests', 4, 'greedy requests')
_GAMMA = flags.DEFINE_integer('gamma', 4, 'draft tokens per round')
_SKIP = flags.DEFINE_integer('skip', 0, 'draft = the first k layers (0: int4 g128 self-draft)')
_TOKENS = flags.DEFINE_integer('max_tokens', 24, 'tokens per request')


def main(_):
  print(f'load average: {os.getloadavg()}', flush=True)
  model, tok, _ = load_gemma3_270m()
  if _SKIP.value:
    draft, name = infer.layer_skip_draft(model, _SKIP.value), f'first {_SKIP.value} layers'
  else:
    policy = QuantPolicy((QuantRule('embed', exempt=True),
                          QuantRule('.*', int_format(4, group_size=128))))
    draft, name = quantize_model(model, policy)[0], 'int4 g128 self-draft'
  ids = tok.encode(corpus('tinyshakespeare')[:50_000]).ids
  prompts = [ids[i * 200:i * 200 + 48] for i in range(_REQUESTS.value)]
  params = infer.SamplingParams(temperature=0.0, max_tokens=_TOKENS.value)
  cfg = infer.EngineConfig(max_batch=_REQUESTS.value, page_size=16,
                           num_pages=1 + _REQUESTS.value * 6, chunk_size=16, max_len=96,
                           ring=False)
  rows = {}
  for label, make in (('engine', lambda: infer.Engine(model, cfg)),
                      ('speculative', lambda: infer.SpeculativeEngine(
                          model, draft, cfg, gamma=_GAMMA.value))):
    make().generate(prompts[:1], params)  # compile
    engine = make()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    rows[label] = dict(seconds=time.perf_counter() - t0, steps=engine.stats.steps, outs=outs,
                       spec=getattr(engine, 'spec_stats', None))
    print(label, f"{rows[label]['seconds']:.1f} s, {engine.stats.steps} steps", flush=True)
  spec = rows['speculative']['spec']
  print(f'\ndraft: {name}, gamma {_GAMMA.value}, {_REQUESTS.value} requests x '
        f'{_TOKENS.value} tokens (load average {os.getloadavg()[0]:.1f})')
  print('| engine | seconds | steps (target passes) |\n|---|---|---|')
  for label, r in rows.items():
    print(f"| {label} | {r['seconds']:.1f} | {r['steps']} |")
  same = rows['engine']['outs'] == rows['speculative']['outs']
  print(f'tokens identical: {same}; alpha {spec.alpha:.3f} (1 - TV: {spec.alpha_tv:.3f}); '
        f'tokens per round {spec.tokens_per_pass:.2f} vs formula '
        f'{spec.expected_tokens_per_pass:.2f}; speedup '
        f"{rows['engine']['seconds'] / rows['speculative']['seconds']:.2f}x")
  if not same:
    raise SystemExit('FAIL: greedy speculative tokens differ from plain greedy.')


if __name__ == '__main__':
  app.run(main)
