"""The fields every validation config shares (configs/validate_gemma3.py, validate_tiny.py).

Not a config to run: `base(**sections)` returns the shared ConfigDict with the sections the
caller gives, and `point(...)` one conversion of `c.points`. The fields:
  base           'gemma3_270m' or 'tiny' (a random TransformerConfig.tiny(**c.tiny));
  tiny_formats   {name: (bits, group or 0)}: the tiny model's format menu (Gemma uses
                 qjax.eval.sensitivity.FORMATS);
  out_dir, resume, run ('all', 'points' or 'frontier'); only: a comma list of point
                 names to run ('' all); fallback_from: a fallback.json written by an earlier
                 run, whose assignment the 'fallback' points reuse ('' recompute);
  eval           perplexity windows, logit tokens, greedy prompts, the long window;
  sensitivity    tokens of the per-layer KL; calib: GPTQ calibration windows;
  tasks          the offline task set (qjax.eval.tasks); memory / latency / context: the
                 report's memory workload, latency runs, context-limit budget (0: skipped);
  points         the conversions validated; frontier: uniform formats vs mixed policies.
"""

import ml_collections


def point(name, kind, method='rtn', fmt='', **kw):
  """One conversion: kind 'uniform' (fmt), 'mixed' (budget_format) or 'fallback' (fmt ->
  high until KL <= threshold); method 'rtn', 'gptq', ... (qjax.algorithms.apply_method)."""
  return ml_collections.ConfigDict(dict(name=name, kind=kind, method=method, format=fmt,
                                        exempt=kw.pop('exempt', ''), high=kw.pop('high', ''),
                                        threshold=kw.pop('threshold', 0.0),
                                        budget_format=kw.pop('budget_format', '')))


def section(**fields) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(fields)


def base(**sections) -> ml_collections.ConfigDict:
  """The shared fields (seed 0, resumable, run everything), updated with `sections`."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.tiny = section(max_len=128)
  c.tiny_formats = section(int8=(8, 0))
  c.resume = True
  c.run = 'all'
  c.only = ''
  c.fallback_from = ''
  c.sensitivity = section(tokens=64)
  c.update(sections)
  return c
