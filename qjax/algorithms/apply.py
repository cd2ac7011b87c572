"""`apply_method`: PTQ of a `qjax.nn.Transformer` by RTN, GPTQ, AWQ, SmoothQuant or LLM.int8().

The policy decides formats exactly as for `quantize_model` (which also builds the starting
point: every matched Einsum RTN-quantized, so the structure, report and checkpoint layout are
the policy's). Then the model is walked block by block and, inside a block, *stage* by stage:
the Einsums that read one array (q/k/v, then o_proj, then gate/up, then down_proj; the
untied LM head last). For each stage the block runs over the calibration batches with a tap
on its inputs (`calibrate.collect_stats`), and the method replaces the stage's weights:

* sequential (default): the batches enter block l through the already-processed blocks
  0..l-1, and a stage sees the already-processed stages before it (GPTQ's sequential mode,
  one block of activations in memory at a time);
* non-sequential: every statistic comes from the float model.

AWQ and SmoothQuant scale the stage's weight rows by s and fold 1/s into the producer of the
shared input (`qjax.algorithms.stages`: the norm, the previous linear layer, or an explicit
input scale in the consumer's description). The calibration record says which, per stage.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from qjax.algorithms import awq, gptq, llm_int8, smoothquant
from qjax.algorithms.calibrate import (EinsumView, calibration_batches, collect_stats, forward,
                                       token_facts)
from qjax.algorithms.stages import (BLOCK_STAGES, HEAD_STAGE, Stage, WalkState, migrate,
                                    module_at, plan_fold, stage_keys)
from qjax.core import layouts
from qjax.nn import (QuantPolicy, QuantReport, Transformer, einsum_layers, quantize_model,
                     relayout_model)

METHODS = ('rtn', 'gptq', 'awq', 'smoothquant', 'llm_int8')
COMMON_OPTIONS = {'sequential': True, 'batch_size': 8, 'source': None, 'seed': None}
METHOD_OPTIONS = {'rtn': {}, 'gptq': gptq.OPTIONS, 'awq': awq.OPTIONS,
                  'smoothquant': smoothquant.OPTIONS, 'llm_int8': llm_int8.OPTIONS}
_KINDS = {'gptq': ('hessian',), 'awq': ('hessian', 'absmean'), 'smoothquant': ('absmax',),
          'llm_int8': ('int8_frac',)}


# ---- options ------------------------------------------------------------------------------
def resolve_options(method: str, options: Optional[dict]) -> dict:
  """The method's defaults updated by `options`; unknown keys and bad values raise."""
  if method not in METHODS:
    raise ValueError(f'apply_method: method={method!r} is unknown; use one of {METHODS}.')
  known = {**COMMON_OPTIONS, **METHOD_OPTIONS[method]}
  bad = set(options or {}) - set(known)
  if bad:
    raise ValueError(f'apply_method({method!r}): unknown options {sorted(bad)}; this method '
                     f'takes {sorted(known)}.')
  opts = {**known, **(options or {})}
  {'gptq': gptq.check_options, 'awq': awq.check_options, 'rtn': lambda o: None,
   'smoothquant': smoothquant.check_options, 'llm_int8': llm_int8.check_options}[method](opts)
  return opts


def embed_fwd(model: Transformer, tokens_BT):
  """The input of block 0: the model's own prologue."""
  return model.embed_tokens(tokens_BT)


def block_fwd(block, x_BTD):
  """One block's cache-free forward at positions 0..T-1 (what `Transformer.blocks` runs)."""
  b, t = x_BTD.shape[:2]
  return block(x_BTD, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), None)[0]


def head_fwd(model: Transformer, x_BTD):
  """The logits of the last block's output: the model's own epilogue (norm, head, softcap)."""
  return model.logits(x_BTD)


# ---- one stage, per method ----------------------------------------------------------------
def _gptq_stage(ctx, stage, prefix, todo, st):
  o = ctx.opts
  for p in todo:
    fmt, layer = ctx.fmts[p][0], module_at(ctx.qmodel, p)
    try:
      q, info = gptq.quantize_layer(ctx.float_weight(p), EinsumView.of(layer, fmt), fmt,
                                    st.hessian, damp=o['damp'], block_size=o['block_size'],
                                    act_order=o['act_order'])
    except ValueError as e:
      raise ValueError(f'apply_method(gptq): layer {p!r} ({st.count} calibration tokens): '
                       f'{e}') from None
    layer.w.set_value(q)
    ctx.layers[p] = info


def _awq_stage(ctx, stage, prefix, todo, st):
  plan = plan_fold(ctx, stage, prefix)
  act, tie = st.absmean, plan[2]
  if tie is not None:  # one scale per kv-head channel: mean |x| over the heads sharing it
    t = jnp.asarray(tie)
    act = (jax.ops.segment_sum(act, t, int(tie.max()) + 1)
           / jax.ops.segment_sum(jnp.ones_like(act), t, int(tie.max()) + 1))[t]
  layers = [(ctx.float_weight(p), EinsumView.of(module_at(ctx.qmodel, p), ctx.fmts[p][0]),
             ctx.fmts[p][0]) for p in todo]
  s_nat, qs, info = awq.search_stage(layers, act, st.hessian, ctx.opts)
  for p, q in zip(todo, qs):
    module_at(ctx.qmodel, p).w.set_value(q)
  fold = migrate(ctx, stage, prefix, todo, s_nat, plan)
  ctx.stages.append({'layers': todo, 'fold': fold, **info})


def _smoothquant_stage(ctx, stage, prefix, todo, st):
  plan = plan_fold(ctx, stage, prefix)
  paths = [prefix + q for q in stage.layers]
  ws = [EinsumView.of(module_at(ctx.qmodel, p)).to_2d(ctx.float_weight(p).astype(jnp.float32))
        for p in paths]
  s_nat = smoothquant.stage_scales(st.absmax, ws, ctx.opts['alpha'], plan[2])
  for p in todo:
    layer, fmt, w = module_at(ctx.qmodel, p), ctx.fmts[p][0], ctx.float_weight(p)
    q = smoothquant.quantize_scaled(w, s_nat, EinsumView.of(layer), fmt)
    layer.w.set_value(q.with_dtype(w.dtype))
  fold = migrate(ctx, stage, prefix, todo, s_nat, plan)
  ctx.stages.append({'layers': todo, 'fold': fold, 'alpha': ctx.opts['alpha'],
                     'scale_range': [float(jnp.min(s_nat)), float(jnp.max(s_nat))]})


def _llm_int8_convert(ctx: WalkState) -> None:
  """Make every matched stage Einsum run LLM.int8() (no calibration needed)."""
  keep = ctx.opts['outlier_weights'] == 'float'
  for stage, prefix in stage_keys(ctx.model).values():
    for p in (prefix + q for q in stage.layers if prefix + q in ctx.fmts):
      llm_int8.convert_layer(module_at(ctx.qmodel, p), ctx.opts['threshold'],
                             ctx.float_weight(p) if keep else None)
      ctx.structure[p] = 'llm_int8'


def _llm_int8_stage(ctx, stage, prefix, todo, st):
  """Record the 8-bit fraction the (already converted) layers see on calibration inputs."""
  for p in todo:
    ctx.layers[p] = {'int8_fraction': float(np.mean(st.int8_frac))}


_STAGE_FNS = {'gptq': _gptq_stage, 'awq': _awq_stage, 'smoothquant': _smoothquant_stage,
              'llm_int8': _llm_int8_stage}


def _process(ctx: WalkState, method: str, stage: Stage, prefix: str, module, fwd, xs) -> None:
  """Calibrate and convert one stage; `module` (block or model) runs `fwd` on `xs`."""
  todo = [prefix + q for q in stage.layers if prefix + q in ctx.fmts]
  if not todo:
    return
  rel = todo[0][len(prefix):]  # the stage's layers share their input: tap one of them
  st = collect_stats(module, fwd, xs, [rel], _KINDS[method], ctx.opts.get('threshold'))[rel]
  rows = EinsumView.of(module_at(module, rel)).rows
  if method in ('gptq', 'awq') and st.count < rows:
    msg = (f'{todo[0]}: {st.count} calibration tokens for {rows} input channels; H is rank-'
           'deficient (damping keeps it invertible) and the fit may not generalise: calibrate '
           'on more tokens than the widest layer input')
    warnings.warn(msg, stacklevel=2)
    ctx.notes.append(msg)
  _STAGE_FNS[method](ctx, stage, prefix, todo, st)


# ---- the public entry point ---------------------------------------------------------------
def _check_formats(method: str, qmodel, fmts: dict) -> None:
  for p, (fmt, act) in fmts.items():
    if method in ('gptq', 'awq') and fmt.is_float:
      raise ValueError(f'apply_method({method!r}): layer {p!r} has weight format {fmt.name}; '
                       f'{method} searches integer codes (bits 2-8). Use an int format, or '
                       "method='rtn' for fp8.")
    if method == 'smoothquant' and act is None:
      raise ValueError(f"apply_method('smoothquant'): layer {p!r} has no activation format; "
                       'SmoothQuant is for W8A8: give the rule act=int_format(8) '
                       "(quant.act='int8').")
    if method == 'llm_int8':
      llm_int8.check_vector_wise(module_at(qmodel, p).w.get_value(), module_at(qmodel, p), p)
    if method in ('gptq', 'awq'):
      layer = module_at(qmodel, p)
      EinsumView.of(layer, fmt).fmt2(fmt)


def apply_method(model: Transformer, policy: QuantPolicy, method: str, calib_tokens,
                 options: Optional[dict] = None, layout: Optional[str] = None):
  """Quantize `model` under `policy` with a PTQ method; the float model is left untouched.

  Args:
    model: a float `qjax.nn.Transformer`.
    policy: the QuantPolicy (formats exactly as `quantize_model` resolves them).
    method: 'rtn', 'gptq', 'awq', 'smoothquant' (W8A8: rules need an act format) or
      'llm_int8' (rules need int8 per-channel weights).
    calib_tokens: [n, T] int token ids (ignored by 'rtn').
    options: common keys `COMMON_OPTIONS` (sequential, batch_size, and the calibration set's
      source and seed, recorded as given) plus the method's (`METHOD_OPTIONS`).
    layout: the QArray storage layout of the result ('packed', 'native', or None for the
      backend's default, `qjax.core.layouts`). The methods search codes in the packed layout;
      the result is converted once at the end.

  Returns:
    (qmodel, QuantReport, calibration_record) - the record is the conversion record's
    'calibration' field: token hash and counts, source, seed, procedure, options, per-stage
    scales and folds, per-layer errors / 8-bit fractions, and `structure` (layers whose
    `EinsumQuant` description the method changed: 'llm_int8' or 'explicit_scale').
  """
  t0 = time.perf_counter()
  opts = resolve_options(method, options)
  layout = layouts.check_layout(layout, 'apply_method')
  qmodel, report = quantize_model(model, policy, layout='packed')
  if method == 'rtn':
    return relayout_model(qmodel, layout), report, {
        'method': 'rtn', 'data': None, 'procedure': _procedure('rtn', opts),
        'seconds': time.perf_counter() - t0}
  if not isinstance(model, Transformer):
    raise ValueError(f'apply_method: expected a qjax.nn.Transformer, got {type(model).__name__}; '
                     'the walk (block inputs, stages, fold targets) is written for it.')
  cfg = model.config
  batches = calibration_batches(calib_tokens, cfg.vocab_size, cfg.max_len, opts['batch_size'])
  fmts = {p: (l.w.get_metadata()['qformat'], l.quant.act_fmt) for p, l in einsum_layers(qmodel)
          if l.quantized}
  _check_formats(method, qmodel, fmts)
  ctx = WalkState(model, qmodel, fmts, opts)
  if method == 'llm_int8':  # converted up front: one model structure to compile per block
    _llm_int8_convert(ctx)
  src = qmodel if opts['sequential'] else model
  xs = [forward(src, embed_fwd, b) for b in batches]
  for i in range(cfg.num_layers):
    for stage in BLOCK_STAGES:
      _process(ctx, method, stage, f'layers/{i}/', src.layers[i], block_fwd, xs)
    xs = [forward(src.layers[i], block_fwd, x) for x in xs]
  if model.lm_head is not None:
    _process(ctx, method, HEAD_STAGE, '', src, head_fwd, xs)
  elif 'embed' in fmts:
    ctx.notes.append('embed (tied LM head) kept RTN: its table is also the input lookup, so it '
                 'can be neither rescaled nor fitted to the head\'s inputs alone')
  record = _record(method, opts, calib_tokens, ctx, time.perf_counter() - t0)
  return relayout_model(qmodel, layout), _report(report, method, ctx), record


def _procedure(method: str, o: dict) -> str:
  seq = ('sequential: block l is calibrated on activations of the already-quantized blocks '
         '0..l-1, and each stage (q/k/v -> o_proj -> gate/up -> down_proj, then the untied '
         'LM head) on those of the already-quantized stages before it' if o['sequential'] else
         'non-sequential: every statistic from the float model')
  text = {
      'rtn': 'none: round-to-nearest (RTN) needs no calibration data; weight ranges from the '
             'weights themselves',
      'gptq': f"GPTQ: H = 2 X^T X / n streamed from each Einsum's inputs; damp {o.get('damp')} "
              f"x mean diag(H); lazy block updates of {o.get('block_size')} rows; act_order="
              f"{o.get('act_order')}; group scales fixed when the sweep reaches the group",
      'awq': f"AWQ: s = mean|x|^alpha (normalised), alpha searched on the summed output error "
             f"1/2 tr(dW^T H dW) of the Einsums sharing the input (grid "
             f"{o.get('alpha') if o.get('alpha') is not None else o.get('alpha_grid')}), "
             f"clip search={o.get('clip_search')}; 1/s folded into the producer (see stages)",
      'smoothquant': f"SmoothQuant: s = max|X|^a / max|W|^(1-a), a={o.get('alpha')}, over the "
                     'concatenated weights sharing the input; 1/s folded into the producer '
                     '(see stages); W8A8 through the policy\'s activation format',
      'llm_int8': f"LLM.int8(): int8 vector-wise matmul; input features with max|x| > "
                  f"{o.get('threshold')} over a call's tokens multiplied in the compute dtype "
                  f"with {o.get('outlier_weights')} weights",
  }[method]
  return text if method == 'rtn' else f'{text}. {seq}; batches of {o["batch_size"]} sequences.'


def _record(method, opts, tokens, ctx: WalkState, seconds) -> dict:
  rec = {'method': method,
         'data': {'source': opts['source'], 'seed': opts['seed'], **token_facts(tokens)},
         'procedure': _procedure(method, opts), 'sequential': opts['sequential'],
         'options': {k: v for k, v in opts.items() if k not in ('source', 'seed')},
         'layers': ctx.layers, 'stages': ctx.stages, 'structure': ctx.structure,
         'notes': ctx.notes, 'seconds': seconds}
  if method == 'llm_int8':
    views = {p: EinsumView.of(module_at(ctx.model, p)) for p in ctx.layers}
    macs = {p: v.rows * v.cols for p, v in views.items()}
    total = sum(macs.values())
    rec['llm_int8'] = {
        'threshold': opts['threshold'], 'outlier_weights': opts['outlier_weights'],
        'int8_fraction': sum(ctx.layers[p]['int8_fraction'] * m for p, m in macs.items()) / total,
        'measured_on': f'the calibration inputs of each layer, per batch of '
                       f"{opts['batch_size']} sequences (outlier columns are chosen per call); "
                       'weighted by multiply-adds'}
  return rec


def _report(report: QuantReport, method: str, ctx: WalkState) -> QuantReport:
  layers = []
  for l in report.layers:
    if l.path in ctx.layers or any(l.path in s['layers'] for s in ctx.stages):
      extra = 0
      if ctx.structure.get(l.path) == 'llm_int8' and ctx.opts['outlier_weights'] == 'float':
        extra = l.bytes_before  # the float copy the outlier columns multiply
      l = dataclasses.replace(l, reason=f'{l.reason}; {method}',
                              bytes_after=l.bytes_after + extra,
                              act=f"int8+float>{ctx.opts['threshold']:g}"
                              if method == 'llm_int8' else l.act)
    layers.append(l)
  return QuantReport(tuple(layers), report.unused_rules, report.mode)
