"""The speculative-decoding experiment: drafts by name, one measured point, the resumable sweep.

`python -m experiments.speculative --config=configs/speculative_gemma3.py` calls
`run_speculative_sweep`; tests run it on the tiny model. A point is (draft, gamma,
temperature): it decodes the same prompts with plain decoding of the target
(`sample_generate`) and with speculative decoding, each timed on a second, warm call, and
records the acceptance statistics (`SpecStats.row`), the speedup, and how the outputs compare:
greedy points the fraction of tokens equal to plain greedy decoding (1.0 when exact), sampled
points the difference of the mean target log-probability per generated token between the two
methods (0 in expectation when both sample the target's distribution; a draft's distribution
leaking through would shift it).

Draft names (`make_draft`): 'float' (the target drafting for itself: alpha = 1, the upper
bound), 'int8', 'int4_g128', 'int3_g128' (RTN weights, embedding kept float), those with
'_gptq' or '_awq' (calibrated by `qjax.algorithms.apply_method`), a '+kv_int4' / '+kv_int8'
suffix (the draft's KV cache quantized too), and 'skip<k>' (the target's first k layers and its
head, `layer_skip_draft`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qjax import eval as qeval
from qjax.core import int_format
from qjax.infer.sampling import SamplingParams, sample_generate
from qjax.infer.speculative import layer_skip_draft, speculative_generate
from qjax.nn import QuantPolicy, QuantRule, quantize_model, with_kv_format
from qjax.nn.attention import kv_format
from qjax.nn.generate import logits_step
from qjax.nn.kvcache import init_cache

_DRAFT_RE = re.compile(r'^(?:(float)|skip(\d+)|int(\d)(?:_g(\d+))?(?:_(rtn|gptq|awq))?)'
                       r'(?:\+kv_(int8|int4|fp8))?$')


def make_draft(target, name: str, calib_tokens=None):
  """The draft called `name` (module docstring) for `target`.

  Args:
    target: the float target `Transformer`.
    name: e.g. 'int4_g128', 'int4_g128_gptq+kv_int4', 'skip6', 'float'.
    calib_tokens: [n, T] calibration token ids, needed by '_gptq' and '_awq'.

  Returns:
    A `Transformer` with the target's vocabulary.
  """
  m = _DRAFT_RE.match(name)
  if not m:
    raise ValueError(f'make_draft: draft {name!r} is not a draft name; use float, skip<k>, '
                     "int<bits>[_g<group>][_rtn|_gptq|_awq][+kv_int8|+kv_int4|+kv_fp8], e.g. "
                     "'int4_g128_gptq+kv_int4'.")
  is_float, skip, bits, group, method, kv = m.groups()
  if is_float:
    draft = target
  elif skip:
    draft = layer_skip_draft(target, int(skip))
  else:
    fmt = int_format(int(bits), group_size=int(group) if group else None)
    policy = QuantPolicy((QuantRule('embed', exempt=True), QuantRule('.*', fmt)))
    method = method or 'rtn'
    if method == 'rtn':
      draft, _ = quantize_model(target, policy)
    else:
      if calib_tokens is None:
        raise ValueError(f'make_draft: {name!r} is calibrated ({method}); pass calib_tokens.')
      from qjax.algorithms import apply_method  # pylint: disable=g-import-not-at-top
      draft, _, _ = apply_method(target, policy, method, calib_tokens)
  if kv:
    draft = with_kv_format(draft, kv)
  return draft


def _timed(fn):
  fn()  # compile
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - t0


_forward = nnx.jit(lambda model, tokens_BT: model(tokens_BT))


def mean_target_logprob(target, tokens_BT: jax.Array, prompt_len: int) -> float:
  """Mean log p_target of the tokens after `prompt_len` (teacher-forced, one forward)."""
  logp_BTV = jax.nn.log_softmax(_forward(target, tokens_BT)[:, prompt_len - 1:-1], axis=-1)
  chosen_BT = jnp.take_along_axis(logp_BTV, tokens_BT[:, prompt_len:, None], axis=-1)
  return float(jnp.mean(chosen_BT))


def step_seconds(model, prompts_BT, repeats: int = 5, num_tokens: int = 1) -> float:
  """Median seconds of one warm cached pass of `num_tokens` tokens after `prompts_BT`.

  num_tokens = 1 is a decode step; gamma + 1 is a speculative verification pass.
  """
  prompts_BT = jnp.asarray(prompts_BT, jnp.int32)
  b, t = prompts_BT.shape
  cache = init_cache(model.config, b, t + num_tokens, fmt=kv_format(model))
  _, cache = logits_step(model, prompts_BT, cache)
  feed_BT = jnp.repeat(prompts_BT[:, -1:], num_tokens, axis=1)
  length_B = np.asarray(cache.length)  # host copy: the cache (its length too) is donated
  times = []
  for i in range(repeats + 1):  # the first call compiles
    t0 = time.perf_counter()
    logits, cache = logits_step(model, feed_BT, cache)
    jax.block_until_ready(logits)
    times.append(time.perf_counter() - t0)
    cache = dataclasses.replace(cache, length=jnp.asarray(length_B))  # the same pass again
  return float(np.median(times[1:]))


def run_point(target, draft, prompts_BT, *, gamma: int, temperature: float,
              max_tokens: int, seed: int = 0, top_p: float = 1.0) -> dict:
  """One point: plain vs speculative decoding of `prompts_BT` by `target` (module docstring).

  Args:
    target: the target `Transformer`.
    draft: the draft.
    prompts_BT: int prompts of one length.
    gamma: draft tokens per target pass.
    temperature: 0 (greedy) or a sampling temperature.
    max_tokens: tokens generated per prompt.
    seed: row b samples with seed + b.
    top_p: nucleus mass of both methods.

  Returns:
    The row: `SpecStats.row()` plus seconds_plain, seconds_spec, speedup, cost_ratio (draft
    step / target step), predicted_speedup, and greedy_agreement (temperature 0) or
    delta_mean_logprob (sampled).
  """
  prompts_BT = jnp.asarray(prompts_BT, jnp.int32)
  b, t = prompts_BT.shape
  params = [SamplingParams(temperature=temperature, top_p=top_p, seed=seed + i)
            for i in range(b)]
  (plain_BT, _), s_plain = _timed(lambda: sample_generate(target, prompts_BT, params,
                                                          max_tokens))
  (spec_BT, stats), s_spec = _timed(lambda: speculative_generate(
      target, draft, prompts_BT, max_tokens, params=params, gamma=gamma))
  # Leviathan et al.'s speedup model: tokens per pass / (gamma * c + 1), c = the draft's
  # step cost in target steps (measured side by side here, so a shared machine biases both).
  cost_ratio = step_seconds(draft, prompts_BT) / step_seconds(target, prompts_BT)
  row = dict(stats.row(), temperature=temperature, max_tokens=max_tokens, batch=b,
             prompt_len=t, seconds_plain=s_plain, seconds_spec=s_spec,
             speedup=s_plain / s_spec, cost_ratio=cost_ratio,
             predicted_speedup=stats.tokens_per_pass / (gamma * cost_ratio + 1))
  if temperature == 0:
    row['greedy_agreement'] = float(np.mean(np.asarray(plain_BT) == np.asarray(spec_BT)))
  else:
    lp_plain = mean_target_logprob(target, plain_BT, t)
    lp_spec = mean_target_logprob(target, spec_BT, t)
    row.update(mean_logprob_plain=lp_plain, mean_logprob_spec=lp_spec,
               delta_mean_logprob=lp_spec - lp_plain)
  return row


def sweep_points(drafts, gammas, temperatures) -> list[tuple[str, dict]]:
  """(name, overrides) for every draft x gamma x temperature."""
  return [(f'{d}/g{g}/t{t}', dict(draft=d, gamma=g, temperature=t))
          for d in drafts for g in gammas for t in temperatures]


def run_speculative_sweep(target, prompts_BT, points: list[tuple[str, dict]], out_dir: str,
                          *, max_tokens: int, calib_tokens=None, base: str = '',
                          log: Callable[[str], None] = print,
                          extra: Optional[dict] = None) -> list[dict]:
  """Run the points not finished yet; rows go to `<out_dir>/results.jsonl` (resumable).

  Args:
    target: the float target.
    prompts_BT: the prompts every point decodes.
    points: `sweep_points(...)`.
    out_dir: where results.jsonl and table.md go.
    max_tokens: tokens generated per prompt.
    calib_tokens: calibration tokens for '_gptq' / '_awq' drafts.
    base: an identifier of the target (its content hash), part of every point's key.
    log: progress printer.
    extra: fields added to every row (e.g. the model name).

  Returns:
    The latest row of every point, in order; also written as a markdown table.
  """
  drafts = {}

  def run(name, ov):
    if ov['draft'] not in drafts:
      drafts.clear()  # one draft alive at a time (a quantized Gemma is ~100 MB+)
      drafts[ov['draft']] = make_draft(target, ov['draft'], calib_tokens)
    row = run_point(target, drafts[ov['draft']], prompts_BT, gamma=ov['gamma'],
                    temperature=ov['temperature'], max_tokens=max_tokens)
    return dict(row, draft=ov['draft'], **(extra or {}))

  prompts_hash = hashlib.sha256(np.asarray(prompts_BT, np.int32).tobytes()).hexdigest()[:16]
  keys = {n: {'base': base, 'config': f'{sorted(ov.items())}|{max_tokens}|{prompts_hash}'}
          for n, ov in points}
  path = os.path.join(out_dir, 'results.jsonl')
  rows = qeval.run_sweep(points, run, path, log=log, keys=keys)
  table = qeval.markdown_table(rows, COLUMNS)
  with open(os.path.join(out_dir, 'table.md'), 'w') as f:
    f.write(table + '\n')
  return rows


COLUMNS = [('name', 'point'), ('status', 'status'), ('alpha', 'alpha'),
           ('alpha_tv', 'alpha (1 - TV)'), ('tokens_per_pass', 'tokens / pass'),
           ('expected_tokens_per_pass', 'formula'), ('passes_per_token', 'passes / token'),
           ('cost_ratio', 'draft / target step'), ('predicted_speedup', 'predicted speedup'),
           ('speedup', 'speedup'), ('greedy_agreement', 'greedy agreement'),
           ('delta_mean_logprob', 'delta mean logprob')]


def _csv(value, cast):
  return [cast(v) for v in str(value).split(',') if v.strip()]


def corpus_prompts(encode: Callable[[str], np.ndarray], num_per_corpus: int,
                   length: int) -> np.ndarray:
  """[2 * num_per_corpus, length] prompts: evenly spaced cuts of both vendored corpora."""
  from qjax import data as qjax_data  # pylint: disable=g-import-not-at-top
  out = []
  for name in ('tinyshakespeare', 'wikitext2_valid'):
    ids = np.asarray(encode(qjax_data.corpus(name)[:200_000]), np.int32)
    starts = np.linspace(0, ids.size - length - 1, num_per_corpus).astype(int)
    out += [ids[s:s + length] for s in starts]
  return np.stack(out)


def run_from_config(config, log: Callable[[str], None] = print) -> list[dict]:
  """The sweep `configs/speculative_gemma3.py` describes (see its docstring for the fields).

  Args:
    config: the ConfigDict (model 'gemma3_270m' or 'tiny', drafts, gammas, temperatures,
      prompts_per_corpus, prompt_len, max_tokens, calib_windows, out_dir).
    log: progress printer.

  Returns:
    The sweep's rows.
  """
  from qjax.nn import Transformer, TransformerConfig  # pylint: disable=g-import-not-at-top
  if config.model == 'tiny':
    target = Transformer(TransformerConfig.tiny(max_len=config.prompt_len + config.max_tokens
                                                + 16), rngs=nnx.Rngs(config.seed))
    encode = lambda text: np.frombuffer(text.encode('utf-8'), np.uint8)  # bytes: V = 256
    base = f'tiny-random-seed{config.seed}'
  elif config.model == 'gemma3_270m':
    from qjax.checkpoints import load_gemma3_270m  # pylint: disable=g-import-not-at-top
    target, tok, info = load_gemma3_270m()
    encode = lambda text: np.asarray(tok.encode(text).ids, np.int32)
    base = str(info.get('sha256', 'gemma3_270m'))
  else:
    raise ValueError(f"speculative sweep: model={config.model!r} is unknown; use 'gemma3_270m' "
                     "or 'tiny'.")
  prompts_BT = corpus_prompts(encode, config.prompts_per_corpus, config.prompt_len)
  calib = None
  if any(m in config.drafts for m in ('gptq', 'awq')):
    calib = corpus_prompts(encode, config.calib_windows, config.calib_len)
  points = sweep_points(_csv(config.drafts, str), _csv(config.gammas, int),
                        _csv(config.temperatures, float))
  return run_speculative_sweep(target, prompts_BT, points, config.out_dir,
                               max_tokens=config.max_tokens, calib_tokens=calib, base=base,
                               log=log, extra=dict(model=config.model))
