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
suffix (the draft's KV cache quantized too), 'skip<k>' (the target's first k layers and its
head, `layer_skip_draft`), 'skip<k>d' (the same distilled to agree with the target, loaded
from `distilled_path`), and a last '+head<K>' suffix on any of them (the head cut to the K
most frequent training tokens, `draft.truncated_head_draft`).

How far the output is from the target's law (the "KL vs plain sampling" columns):
kl_exact is the mean over reached draft positions of KL(emitted law || p), the emitted law
computed from p and q as verify draws it (min(p, q) + (1 - beta) norm(max(0, p - q))); it is
0 up to float rounding (~1e-7) when the verification is exact. With `kl_rows` > 0 a point
also decodes one token for kl_rows seeded rows of its first prompt speculatively and
reports the plug-in KL(histogram || p) of that first token (kl_spec), the same for as many
plain rows (kl_plain), and the mean and spread of the statistic over multinomial samples of
the same size drawn from p (kl_null_mean, kl_null_std): the plug-in KL is biased upward by
the sample size, so only kl_z = (kl_spec - kl_null_mean) / kl_null_std is to be read (|z|
of a few when exact; the sample is small, so this detects only gross leaks of the draft).
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
from qjax.eval.report import figure, pyplot, save_figure
from qjax.pipeline import draft as qdraft
from qjax.infer.sampling import SamplingBatch, SamplingParams, processed_logits, sample_generate
from qjax.infer.speculative import layer_skip_draft, speculative_generate
from qjax.nn import QuantPolicy, QuantRule, quantize_model, with_kv_format
from qjax.nn.attention import kv_format
from qjax.nn.generate import logits_step
from qjax.nn.kvcache import init_cache

_DRAFT_RE = re.compile(r'^(?:(float)|skip(\d+)(d?)|int(\d)(?:_g(\d+))?(?:_(rtn|gptq|awq))?(_a8)?)'
                       r'(?:\+kv_(int8|int4|fp8))?(?:\+head(\d+))?$')


def train_text(name: str = 'tinyshakespeare') -> str:
  """The draft-training text: the corpus's train part (its first 90%, `qjax.train.data`'s
  split) after the first 200,000 characters that `corpus_prompts` cuts the prompts from, so
  no scored prompt is trained on."""
  from qjax import data as qjax_data  # pylint: disable=g-import-not-at-top
  text = qjax_data.corpus(name)
  return text[200_000:int(len(text) * 0.9)]


def distilled_path(out_dir: str, num_layers: int) -> str:
  """Where `skip<k>d` drafts are saved / loaded (`draft.save_distilled`)."""
  return os.path.join(out_dir, f'skip{num_layers}_distilled.npz')


def make_draft(target, name: str, calib_tokens=None, head_tokens=None,
               distilled_dir: Optional[str] = None):
  """The draft called `name` (module docstring) for `target`.

  Args:
    target: the float target `Transformer`.
    name: e.g. 'int4_g128', 'int4_g128_gptq+kv_int4', 'skip6', 'skip6d+head8192', 'float'.
    calib_tokens: [n, T] calibration token ids, needed by '_gptq' and '_awq'.
    head_tokens: training token ids whose most frequent K form a '+head<K>' draft's head.
    distilled_dir: the folder holding 'skip<k>d' drafts (`distilled_path`).

  Returns:
    A `Transformer` with the target's vocabulary.
  """
  m = _DRAFT_RE.match(name)
  if not m:
    raise ValueError(f'make_draft: draft {name!r} is not a draft name; use float, skip<k>[d], '
                     "int<bits>[_g<group>][_rtn|_gptq|_awq][_a8], then optionally "
                     "+kv_int8|+kv_int4|+kv_fp8 and +head<K>, e.g. 'int4_g128_gptq+kv_int4' "
                     "or 'skip6d+head8192'.")
  is_float, skip, distilled, bits, group, method, a8, kv, head = m.groups()
  if is_float:
    draft = target
  elif skip and distilled:
    path = distilled_path(distilled_dir or '.', int(skip))
    if not os.path.exists(path):
      raise ValueError(f'make_draft: {name!r} needs a distilled draft at {path}; make it with '
                       f'`python -m benchmarks.speculative_bench --mode=drafts '
                       f'--skip={skip}` (qjax.pipeline.draft.distill_layer_skip) or set '
                       'distilled_dir.')
    draft = qdraft.load_distilled(target, path)
  elif skip:
    draft = layer_skip_draft(target, int(skip))
  else:
    fmt = int_format(int(bits), group_size=int(group) if group else None)
    if a8:  # every weight, tied head included, with dynamic int8 activations (W4A8 / W8A8)
      policy = QuantPolicy((QuantRule('.*', fmt, act=int_format(8)),))
    else:
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
  if head:
    if head_tokens is None:
      raise ValueError(f'make_draft: {name!r} has a truncated head; pass head_tokens (the '
                       'training text as token ids) to choose its frequent tokens.')
    draft = qdraft.truncated_head_draft(draft, qdraft.frequent_tokens(head_tokens, int(head)))
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
  for _ in range(repeats + 1):  # the first call compiles
    t0 = time.perf_counter()
    logits, cache = logits_step(model, feed_BT, cache)
    jax.block_until_ready(logits)
    times.append(time.perf_counter() - t0)
    cache = dataclasses.replace(cache, length=jnp.asarray(length_B))  # the same pass again
  return float(np.median(times[1:]))


def _plugin_kl(counts_V: np.ndarray, p_V: np.ndarray) -> float:
  """KL(counts / n || p) in nats (inf when a count falls where p = 0)."""
  f_V = counts_V / counts_V.sum()
  nz = f_V > 0
  with np.errstate(divide='ignore'):
    return float(np.sum(f_V[nz] * (np.log(f_V[nz]) - np.log(p_V[nz]))))


def first_token_kl(target, draft, prompt_T, *, rows: int, gamma: int, temperature: float,
                   top_p: float = 1.0, seed: int = 0, null_draws: int = 200) -> dict:
  """Empirical KL of the first generated token vs the target's law, with its sampling noise.

  `rows` seeded speculative rows and `rows` plain rows (other seeds) of one prompt each emit
  one token; p is the target's processed law of that token (one forward). Returned: the
  plug-in KL(histogram || p) of both samples, and the mean and standard deviation of the same
  statistic over `null_draws` multinomial samples of `rows` draws from p itself: what an exact
  sampler gives at this sample size. kl_z = (kl_spec - null mean) / null std is ~N(0, 1)-sized
  when the speculative output follows p; a draft leaking through pushes it up.
  """
  prompt_BT = jnp.repeat(jnp.asarray(prompt_T, jnp.int32)[None], rows, axis=0)
  spec_params = [SamplingParams(temperature=temperature, top_p=top_p, seed=seed + i)
                 for i in range(rows)]
  plain_params = [SamplingParams(temperature=temperature, top_p=top_p,
                                 seed=seed + rows + i) for i in range(rows)]
  spec_BT, _ = speculative_generate(target, draft, prompt_BT, 1, params=spec_params,
                                    gamma=gamma)
  plain_BT, _ = sample_generate(target, prompt_BT, plain_params, 1)
  logits_1V = _forward(target, prompt_BT[:1])[:, -1]
  p_V = np.exp(np.asarray(processed_logits(logits_1V, SamplingBatch.stack(spec_params[:1]))),
               dtype=np.float64)[0]
  p_V /= p_V.sum()
  v = p_V.size
  counts = lambda tok_B: np.bincount(np.asarray(tok_B), minlength=v)
  null = [_plugin_kl(c, p_V) for c in
          np.random.default_rng(seed).multinomial(rows, p_V, size=null_draws)]
  kl_spec = _plugin_kl(counts(spec_BT[:, -1]), p_V)
  mean, std = float(np.mean(null)), float(np.std(null))
  return dict(kl_rows=rows, kl_spec=kl_spec, kl_plain=_plugin_kl(counts(plain_BT[:, -1]), p_V),
              kl_null_mean=mean, kl_null_std=std,
              kl_z=(kl_spec - mean) / std if std > 0 else (0.0 if kl_spec == mean else
                                                            float('inf')))


def run_point(target, draft, prompts_BT, *, gamma: int, temperature: float,
              max_tokens: int, seed: int = 0, top_p: float = 1.0, kl_rows: int = 0,
              cost_ratio: Optional[float] = None) -> dict:
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
    kl_rows: > 0 adds the `first_token_kl` columns, from that many rows of the first prompt.
    cost_ratio: the draft / target step cost if already measured (a sweep measures it once
      per draft); None measures it.

  Returns:
    The row: `SpecStats.row()` (kl_exact included) plus seconds_plain, seconds_spec,
    speedup, cost_ratio (draft step / target step), predicted_speedup, greedy_agreement
    (temperature 0) or delta_mean_logprob (sampled), and the kl_* columns when asked.
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
  if cost_ratio is None:
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
  if kl_rows:
    row.update(first_token_kl(target, draft, prompts_BT[0], rows=kl_rows, gamma=gamma,
                              temperature=temperature, top_p=top_p, seed=seed + 1_000_000))
  return row


def sweep_points(drafts, gammas, temperatures) -> list[tuple[str, dict]]:
  """(name, overrides) for every draft x gamma x temperature."""
  return [(f'{d}/g{g}/t{t}', dict(draft=d, gamma=g, temperature=t))
          for d in drafts for g in gammas for t in temperatures]


def run_speculative_sweep(target, prompts_BT, points: list[tuple[str, dict]], out_dir: str,
                          *, max_tokens: int, calib_tokens=None, base: str = '',
                          log: Callable[[str], None] = print,
                          extra: Optional[dict] = None, kl_rows: int = 0, head_tokens=None,
                          distilled_dir: Optional[str] = None,
                          time_budget_s: Optional[float] = None) -> list[dict]:
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
    kl_rows: rows of the first prompt for the `first_token_kl` columns (0: off).
    head_tokens, distilled_dir: for '+head<K>' and 'skip<k>d' drafts (`make_draft`).
    time_budget_s: once this many seconds have passed, the remaining points are recorded as
      not run (status 'error', its error containing `BUDGET_SPENT`) without running; a rerun
      continues with them. None: no limit.

  Returns:
    The latest row of every point, in order; also written as a markdown table and, when any
    point succeeded, `plot.png` (`plot_sweep`).
  """
  drafts, costs = {}, {}
  start = time.perf_counter()

  def run(name, ov):
    if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
      raise RuntimeError(f'{BUDGET_SPENT} of {time_budget_s:.0f} s was spent before this '
                         'point; rerun the same command to continue.')
    if ov['draft'] not in drafts:
      drafts.clear()  # one draft alive at a time (a quantized Gemma is ~100 MB+)
      drafts[ov['draft']] = make_draft(target, ov['draft'], calib_tokens, head_tokens,
                                       distilled_dir)
    draft = drafts[ov['draft']]
    if ov['draft'] not in costs:  # c once per draft: it depends on neither gamma nor T
      costs[ov['draft']] = step_seconds(draft, prompts_BT) / step_seconds(target, prompts_BT)
    row = run_point(target, draft, prompts_BT, gamma=ov['gamma'],
                    temperature=ov['temperature'], max_tokens=max_tokens, kl_rows=kl_rows,
                    cost_ratio=costs[ov['draft']])
    return dict(row, draft=ov['draft'], **(extra or {}))

  prompts_hash = hashlib.sha256(np.asarray(prompts_BT, np.int32).tobytes()).hexdigest()[:16]
  keys = {n: {'base': base,
              'config': f'{sorted(ov.items())}|{max_tokens}|{prompts_hash}|kl{kl_rows}'}
          for n, ov in points}
  path = os.path.join(out_dir, 'results.jsonl')
  rows = qeval.run_sweep(points, run, path, log=log, keys=keys)
  table = qeval.markdown_table(rows, COLUMNS)
  with open(os.path.join(out_dir, 'table.md'), 'w') as f:
    f.write(table + '\n')
  if any(r.get('status') == 'ok' for r in rows):
    plot_sweep(rows, os.path.join(out_dir, 'plot.png'))
  return rows


BUDGET_SPENT = 'not run: the time budget'


def draft_bits(name: str) -> Optional[int]:
  """The weight bits of a self-draft name ('float' 32, 'int4_g128' 4); None for others."""
  m = _DRAFT_RE.match(name)
  if not m or m.group(2) or m.group(9):  # layer skip or truncated head: not a bits point
    return None
  return 32 if m.group(1) else int(m.group(4))


@figure
def plot_sweep(rows: list[dict], path: str) -> None:
  """Two panels: alpha vs draft weight bits (self-drafts, one line per temperature, gamma
  pooled by the mean) and measured speedup vs gamma (one line per draft, temperature 0)."""
  plt = pyplot()
  ok = [r for r in rows if r.get('status') == 'ok']
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  for t in sorted({r['temperature'] for r in ok}):
    by_bits = {}
    for r in ok:
      bits = draft_bits(r['draft'])
      if r['temperature'] == t and bits is not None and '+kv' not in r['draft']:
        by_bits.setdefault(bits, []).append(r['alpha'])
    if by_bits:
      xs = sorted(by_bits)
      ax1.plot(xs, [np.mean(by_bits[x]) for x in xs], 'o-', label=f'T={t}')
  ax1.set_xscale('log', base=2)
  ax1.set_xlabel('draft weight bits (RTN / GPTQ / AWQ pooled; 32 = float)')
  ax1.set_ylabel('alpha (per-position acceptance)')
  if ax1.lines:
    ax1.legend()
  greedy = [r for r in ok if r['temperature'] == min(x['temperature'] for x in ok)]
  for d in dict.fromkeys(r['draft'] for r in greedy):
    pts = sorted((r['gamma'], r['speedup']) for r in greedy if r['draft'] == d)
    ax2.plot([g for g, _ in pts], [s for _, s in pts], 'o-', label=d)
  ax2.axhline(1.0, color='gray', lw=0.8)
  ax2.set_xlabel('gamma (draft tokens per target pass)')
  ax2.set_ylabel('wall-clock speedup over plain decoding')
  ax2.set_title(f"T={greedy[0]['temperature'] if greedy else 0}")
  if ax2.lines:
    ax2.legend(fontsize=7)
  fig.tight_layout()
  save_figure(fig, path, dpi=100)


COLUMNS = [('name', 'point'), ('status', 'status'), ('alpha', 'alpha'),
           ('alpha_tv', 'alpha (1 - TV)'), ('tokens_per_pass', 'tokens / pass'),
           ('expected_tokens_per_pass', 'formula'), ('passes_per_token', 'passes / token'),
           ('cost_ratio', 'draft / target step'), ('predicted_speedup', 'predicted speedup'),
           ('speedup', 'speedup'), ('greedy_agreement', 'greedy agreement'),
           ('delta_mean_logprob', 'delta mean logprob'), ('kl_exact', 'KL exact'),
           ('kl_spec', 'KL first token'), ('kl_null_mean', 'KL null mean'),
           ('kl_null_std', 'KL null std'), ('kl_z', 'KL z')]


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
      prompts_per_corpus, prompt_len, max_tokens, calib_windows, out_dir; optional kl_rows,
      distilled_dir).
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
  head = encode(train_text()) if '+head' in config.drafts else None
  points = sweep_points(_csv(config.drafts, str), _csv(config.gammas, int),
                        _csv(config.temperatures, float))
  return run_speculative_sweep(target, prompts_BT, points, config.out_dir,
                               max_tokens=config.max_tokens, calib_tokens=calib, base=base,
                               log=log, extra=dict(model=config.model),
                               kl_rows=config.get('kl_rows', 0), head_tokens=head,
                               distilled_dir=config.get('distilled_dir') or None,
                               time_budget_s=config.get('time_budget_s') or None)
