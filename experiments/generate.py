r"""Type a prompt, watch the engine stream the continuation (Gemma 3 270M, a tiny model, or a
checkpoint written by `experiments.convert`).

  XLA_FLAGS= .venv/bin/python -m experiments.generate --config=configs/engine_generate.py \
      --prompt='To be, or not to be, that is the'
  python -m experiments.generate --config.checkpoint=OUT --prompt='Hello' [--config.chat=True]

Without --prompt, prompts are read from stdin, one per line. See the config's docstring.
"""

import os
import sys
import time

from absl import flags
from flax import nnx

from qjax import infer
from qjax.pipeline import cli
from qjax.core import int_format
from qjax.nn import (QuantPolicy, QuantRule, Transformer, TransformerConfig, kv_format,
                     quantize_model, with_kv_format)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIG = cli.define_config(os.path.join(ROOT, 'configs', 'engine_generate.py'), ROOT,
                            lock_config=True, prog='experiments.generate')
_PROMPT = flags.DEFINE_multi_string('prompt', [], 'prompt(s); none: read stdin lines')

MODELS = ('gemma3_270m', 'tiny')
WEIGHTS = {'int8': int_format(8), 'int4_g128': int_format(4, group_size=128)}


class _Bytes:
  """The tiny model's tokenizer: one token per UTF-8 byte."""

  def encode(self, text):
    return list(text.encode('utf-8'))

  def decode(self, ids):
    return bytes(ids).decode('utf-8', errors='replace')


def _model(c):
  if c.checkpoint:  # a convert output: quantized weights, its tokenizer and chat template
    from qjax.pipeline.convert import load_converted  # pylint: disable=g-import-not-at-top
    model, tok, record = load_converted(c.checkpoint)
    print(f"loaded {c.checkpoint}: {record['method']}, {record['base_checkpoint']['source']}",
          file=sys.stderr)
    return model, tok
  if c.chat:
    raise ValueError('--config.chat=True applies the chat template of a converted checkpoint; '
                     'pass --config.checkpoint=OUT (python -m experiments.convert writes one).')
  if c.model not in MODELS:
    raise ValueError(f'--config.model={c.model!r} is not a model this command loads; use one '
                     f'of {MODELS}, or --config.checkpoint=OUT for a converted checkpoint.')
  if c.model == 'tiny':
    cfg = TransformerConfig.tiny(max_len=c.engine.max_len)
    return Transformer(cfg, rngs=nnx.Rngs(c.seed)), _Bytes()
  from qjax.checkpoints.gemma3 import load_gemma3_270m  # pylint: disable=g-import-not-at-top
  model, tok, info = load_gemma3_270m()
  print(f"loaded Gemma 3 270M in {info['seconds']:.1f} s", file=sys.stderr)
  return model, tok


def _kv_and_temperature(c, model) -> tuple:
  """(model, KV format or None for float, temperature) to run: what the config asks, else a
  checkpoint's own precision (the KV format it was converted with, float when none; greedy)
  or, for `model`, an int8 cache at 0.7."""
  temperature = c.temperature
  if temperature is None:
    temperature = 0.0 if c.checkpoint else 0.7
  kv = c.kv_format
  if kv is None and c.checkpoint:  # the checkpoint's own (EngineConfig reads the model's)
    return model, None, temperature
  fmt = None if kv in ('float', '') else (kv or 'int8')
  if kv_format(model) is not None:  # converted with another KV format than the one asked
    model = with_kv_format(model, fmt)
  return model, fmt, temperature


def main(argv):
  del argv
  c = _CONFIG.value
  blank = [p for p in _PROMPT.value if not p.strip()]
  if blank:
    raise ValueError(f'--prompt={blank[0]!r} is empty; give the text to continue (or leave '
                     '--prompt out to read prompts from stdin).')
  model, tok = _model(c)
  if c.weights != 'float' and not c.checkpoint:  # a checkpoint is quantized already
    if c.weights not in WEIGHTS:
      raise ValueError(f'--config.weights={c.weights!r}; use float or one of '
                       f'{sorted(WEIGHTS)}.')
    policy = QuantPolicy((QuantRule('embed', exempt=True), QuantRule('.*', WEIGHTS[c.weights])))
    model, _ = quantize_model(model, policy)
  engine_cfg = dict(c.engine, max_len=min(c.engine.max_len, model.config.max_len))
  model, kv, temperature = _kv_and_temperature(c, model)
  engine = infer.Engine(model, infer.EngineConfig(kv_format=kv, **engine_cfg),
                        tokenizer=tok)
  stop = tuple(getattr(tok, 'stop_ids', ()))
  print(f'generating with weights {c.checkpoint or c.weights}, KV cache '
        f'{engine.cache.format}, temperature {temperature:g}'
        f'{" (greedy)" if temperature == 0 else f", top_p {c.top_p:g}, top_k {c.top_k}"}, '
        f'up to {c.max_tokens} tokens, context {engine.max_len} '
        '(--config.kv_format, --config.temperature, --config.max_tokens, '
        '--config.engine.max_len)', file=sys.stderr)
  prompts = _PROMPT.value or (line.rstrip('\n') for line in sys.stdin)
  for i, prompt in enumerate(prompts):
    if not prompt:
      break
    params = infer.SamplingParams(temperature=temperature, top_p=c.top_p, top_k=c.top_k,
                                  repetition_penalty=c.repetition_penalty,
                                  max_tokens=c.max_tokens, seed=c.seed + i, stop_tokens=stop)
    text = tok.chat(prompt) if c.chat else prompt
    ids = text if not isinstance(text, str) else tok.encode(text)
    ids = list(getattr(ids, 'ids', ids))
    cli.check_context(i, len(ids), c.max_tokens, engine.max_len, model.config.max_len)
    t0 = time.perf_counter()
    print(prompt, end='\n' if c.chat else '', flush=True)
    for piece in engine.stream_text(ids, params):
      print(piece, end='', flush=True)
    seconds = time.perf_counter() - t0
    print(f'\n[{c.max_tokens} tokens max, {seconds:.1f} s incl. compilation on the first '
          f'prompt; weights {c.checkpoint or c.weights}, KV {engine.cache.format}]',
          file=sys.stderr)


if __name__ == '__main__':
  cli.run(main, 'experiments.generate')
