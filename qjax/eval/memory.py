"""Memory planner: predict the bytes a model needs from its config and quantization policy,
answer "what fits in N GiB", and measure the same quantities on a built model.

Prediction (no model is built; `nnx.eval_shape` gives the Einsum shapes):
  weights      per Einsum: codes packed as `qjax.core.packing` stores them
               (prod(shape[:-1]) * packed_length(shape[-1], bits)), + scales (one per tile,
               `numerics.scale_shape`, in the scale dtype) + zero points (asymmetric formats,
               same count and dtype); unquantized Einsums and every other parameter (norms)
               at the parameter dtype;
  KV cache     2 * L * B * S * K * H * itemsize (seed 000, sec. 4.2) for a float cache; codes
               + one scale per token and kv head for a quantized one; a sliding-window layer
               holds window + ring slack slots where shorter (`qjax.nn.init_cache`'s ring);
  activations  the largest live set of one step: either a stated estimate
               (`activation_bytes`, plus a cache copy XLA:CPU makes in a batch-1 decode step)
               or, with `compiled=True`, exactly what XLA allocates: the step compiled from
               shapes alone (`abstract_model`: `nnx.eval_shape` of the quantized model, no
               weight materialised), its `memory_analysis()` temp + unaliased output.

Measurement (`measure`): the device buffers of the model's state and of an empty cache, the
compiled prefill / decode steps' temp, argument and output sizes, and the process' peak RSS.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from qjax.core import QFormat, packing
from qjax.core.numerics import scale_shape
from qjax.eval import process
from qjax.nn import (QuantPolicy, Transformer, TransformerConfig, einsum_layers, init_cache,
                     kv_format, quantize_model, resolve_format, with_kv_format)
from qjax.nn import attention_forms
from qjax.nn.kvcache import DEFAULT_RING_SLACK, check_format

GiB = 2 ** 30


# ---------------------------------------------------------------------------- shapes
@functools.lru_cache(maxsize=8)
def _abstract(cfg: TransformerConfig):
  return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def layer_table(cfg: TransformerConfig) -> list[tuple[str, object]]:
  """(path, abstract Einsum) of every projection of a model with config `cfg` (none built)."""
  return einsum_layers(_abstract(cfg))


def qformat_bytes(shape: Sequence[int], fmt: QFormat) -> dict:
  """Bytes of one weight stored in the resolved format `fmt` (axes filled in).

  Returns:
    {'codes', 'scales', 'zero_points', 'total'} in bytes, as `qjax.core.nbytes` counts them.
  """
  shape = tuple(int(d) for d in shape)
  code_bytes = 1 if fmt.bits > 4 or fmt.is_float else None
  if code_bytes is None:
    codes = math.prod(shape[:-1]) * packing.packed_length(shape[-1], fmt.bits)
  else:
    codes = math.prod(shape)
  n_scales = math.prod(scale_shape(shape, fmt))
  item = jnp.dtype(fmt.scale_dtype).itemsize
  zp = 0 if fmt.symmetric else n_scales * item
  return {'codes': codes, 'scales': n_scales * item, 'zero_points': zp,
          'total': codes + n_scales * item + zp}


def layer_formats(cfg: TransformerConfig, policy: Optional[QuantPolicy]) -> dict:
  """{path: resolved QFormat or None (float)} under `policy`, as `quantize_model` resolves it."""
  out = {}
  for path, layer in layer_table(cfg):
    _, rule = (None, None) if policy is None else policy.match(path)
    if rule is None or rule.exempt:
      out[path] = None
    else:
      out[path] = resolve_format(rule, layer, path, policy.path)
  return out


def weight_bytes(cfg: TransformerConfig, policy: Optional[QuantPolicy] = None,
                 formats: Optional[Mapping[str, Optional[QFormat]]] = None) -> dict:
  """Predicted weight bytes of `cfg` under `policy` (or explicit resolved `formats`).

  Returns:
    {'codes', 'scales', 'zero_points', 'float' (unquantized Einsums + norms), 'total',
     'layers': {path: bytes}}.
  """
  formats = layer_formats(cfg, policy) if formats is None else formats
  pitem = jnp.dtype(cfg.param_dtype).itemsize
  out = {'codes': 0, 'scales': 0, 'zero_points': 0, 'float': 0, 'layers': {}}
  einsum_params = 0
  for path, layer in layer_table(cfg):
    shape = layer.weight_shape
    einsum_params += math.prod(shape)
    fmt = formats.get(path)
    if fmt is None:
      b = math.prod(shape) * pitem
      out['float'] += b
    else:
      parts = qformat_bytes(shape, fmt)
      for k in ('codes', 'scales', 'zero_points'):
        out[k] += parts[k]
      b = parts['total']
    out['layers'][path] = b
  # Norm weights (and biases): every parameter that is not an Einsum weight stays float.
  total_params = sum(math.prod(a.shape) for a in jax.tree.leaves(
      nnx.state(_abstract(cfg), nnx.Param)))
  out['float'] += (total_params - einsum_params) * pitem
  out['total'] = out['codes'] + out['scales'] + out['zero_points'] + out['float']
  return out


def kv_bytes(cfg: TransformerConfig, batch: int, context: int,
             fmt: Optional[QFormat | str] = None, *, ring: bool = True,
             ring_slack: int = DEFAULT_RING_SLACK) -> int:
  """KV-cache bytes for `batch` sequences of `context` tokens (float or a KV format).

  As `qjax.nn.init_cache` lays it out: every layer K and V of `context` slots, except that a
  sliding-window layer keeps a ring of window + `ring_slack` slots where that is shorter
  (`ring=True`, init_cache's default); + the int32 lengths.
  """
  fmt = check_format(fmt, cfg.head_dim)
  total = 0
  for layer in range(cfg.num_layers):
    w = cfg.window(layer) if ring else None
    slots = w + ring_slack if w is not None and w + ring_slack < context else context
    shape = (batch, slots, cfg.num_kv_heads, cfg.head_dim)
    if fmt is None:
      total += 2 * math.prod(shape) * jnp.dtype(cfg.dtype).itemsize
    else:
      total += 2 * qformat_bytes(shape, fmt)['total']
  return total + 4 * batch


def activation_bytes(cfg: TransformerConfig, batch: int, tokens: int, context: int,
                     on: Optional[str] = None) -> int:
  """Estimated peak live activations of one step of `tokens` new tokens per row (f32 logits).

  The step's largest simultaneous buffers: the float32 logits of every fed position
  (B * T * V), the MLP's gate and up outputs (2 * B * T * F), a few residual-stream copies
  (4 * B * T * D), the queries and new keys/values (B * T * (N + 2K) * H) and one layer's
  attention scores as the form chosen on platform `on` (default: this process's) holds them
  (`attention_scores_bytes`). In the compute dtype, logits float32.
  """
  c = jnp.dtype(cfg.dtype).itemsize
  b, t = batch, tokens
  logits = b * t * cfg.vocab_size * 4
  mlp = 2 * b * t * cfg.d_ff * c
  resid = 4 * b * t * cfg.d_model * c
  qkv = b * t * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * c
  return logits + mlp + resid + qkv + attention_scores_bytes(cfg, b, t, context, on)


def attention_scores_bytes(cfg: TransformerConfig, batch: int, tokens: int, context: int,
                           on: Optional[str] = None) -> int:
  """One layer's live f32 attention scores for T queries over S keys, by the form
  `attention_forms.choose_form` picks on platform `on`: dense forms (decode's 'reduce' and
  XLA's dot_product_attention too) hold B * N * T * S, the blockwise scan one block of keys, a fused
  kernel (cuDNN flash, splash) only each query row's softmax statistics."""
  s = min(context, cfg.max_len)
  form = attention_forms.choose_form(cfg.attention_impl, t=tokens, dtype=cfg.dtype,
                                     head_dim=cfg.head_dim,
                                     logit_softcap=cfg.attn_logit_softcap, on=on).name
  keys = {'dense': s, 'reduce': s, 'sdpa_xla': s,
          'blockwise': min(s, cfg.attention_block)}.get(form, 1)
  return batch * cfg.num_heads * tokens * keys * 4


# ---------------------------------------------------------------------------- planner
@dataclasses.dataclass(frozen=True)
class Prediction:
  """Predicted bytes of one workload: weights + KV + the larger step's activations."""

  weights: dict
  kv: int
  prefill_activations: int
  decode_activations: int

  @property
  def total(self) -> int:
    return self.weights['total'] + self.kv + max(self.prefill_activations,
                                                   self.decode_activations)

  def as_dict(self) -> dict:
    w = {k: v for k, v in self.weights.items() if k != 'layers'}
    return {'weights': w, 'kv': self.kv, 'prefill_activations': self.prefill_activations,
            'decode_activations': self.decode_activations, 'total': self.total}


def predict(cfg: TransformerConfig, policy: Optional[QuantPolicy] = None, *, batch: int,
            context: int, prompt: Optional[int] = None, kv: Optional[QFormat | str] = None,
            formats=None, compiled: bool = False, on: Optional[str] = None) -> Prediction:
  """Predicted memory of serving `batch` sequences of `context` tokens (prompt `prompt`).

  Args:
    cfg: the model config.
    policy: its quantization policy (None: float), or `formats` {path: resolved QFormat}.
    batch, context: sequences and cache length.
    prompt: prefill tokens per row (default: `context`).
    kv: the KV-cache format (None float).
    compiled: activations from XLA's memory analysis of the prefill and decode steps compiled
      from shapes alone (`compiled_step_bytes`; needs `policy`, not `formats`), instead of
      the estimate.
    on: the platform the estimate is for ('cpu', 'nvidia', 'tpu'; default this process's):
      it decides the attention form of the prefill (`attention_scores_bytes`).

  Returns:
    A `Prediction`.
  """
  _check_workload(cfg, batch, context)
  prompt = context if prompt is None else prompt
  kv_b = kv_bytes(cfg, batch, context, kv)
  weights = weight_bytes(cfg, policy, formats)
  if compiled:
    if formats is not None:
      raise ValueError('predict: compiled=True builds the abstract model from `policy`; pass '
                       'the policy instead of formats.')
    acts = [step_activations(compiled_step_bytes(cfg, policy, batch=batch, tokens=t,
                                                 context=context, kv=kv))
            for t in (prompt, 1)]
    return Prediction(weights, kv_b, *acts)
  return Prediction(weights, kv_b, activation_bytes(cfg, batch, prompt, context, on),
                    activation_bytes(cfg, batch, 1, context, on) + decode_cache_copy(cfg, batch,
                                                                                     kv_b))


def decode_cache_copy(cfg: TransformerConfig, batch: int, kv: int) -> int:
  """Bytes of the cache copy the estimate adds to a decode step's activations.

  On XLA:CPU a batch-1 decode step's temp holds one more copy of the whole cache and a
  larger batch's none (`compiled_step_bytes` on Gemma 3 270M; docs/validation.md). XLA's
  buffer assignment decides this, so the estimate counts the batch-1 copy and
  `compiled=True` asks XLA instead.
  """
  del cfg
  return kv if batch == 1 else 0


def _check_workload(cfg, batch, context):
  for name, v in (('batch', batch), ('context', context)):
    if not isinstance(v, int) or v < 1:
      raise ValueError(f'memory planner: {name}={v!r} must be a positive integer.')
  if context > cfg.max_len:
    raise ValueError(f'memory planner: context={context} exceeds the model\'s max_len='
                     f'{cfg.max_len}; plan a context <= max_len.')


def _largest(ok, lo: int, hi: int) -> int:
  """Largest n in [lo, hi] with ok(n) (ok monotone decreasing), or 0 if ok(lo) fails."""
  if not ok(lo):
    return 0
  while lo < hi:
    mid = (lo + hi + 1) // 2
    lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
  return lo


def what_fits(cfg: TransformerConfig, budget_bytes: float,
              policies: Mapping[str, Optional[QuantPolicy]], *, batch: int = 1,
              context: int = 0, prompt: Optional[int] = None,
              kv: Optional[QFormat | str] = None, max_batch: int = 4096,
              compiled: bool = False) -> dict:
  """Answer "what fits in `budget_bytes`" for each named policy.

  Decode is the phase planned (the cache at its full length, one new token per row); the
  prefill of `prompt` tokens per row (default 1: a chunked prefill) must fit too.

  Args:
    cfg: the model config.
    budget_bytes: the memory budget (e.g. 8 * GiB).
    policies: {name: QuantPolicy or None (float)}, e.g. {'f32': None, 'int4-g128': ...}.
    batch: the batch at which the longest context is sought.
    context: the context at which the largest batch is sought (default `cfg.max_len`).
    prompt: prefill chunk in tokens (default 1).
    kv: KV-cache format.
    max_batch: search bound for the batch.
    compiled: search with `predict(..., compiled=True)` (one XLA compile per probe, from the
      estimate's answer outwards; minutes on a real model).

  Returns:
    {name: {'weights', 'fits' (at batch x context), 'total' (bytes there), 'max_batch'
     (at `context`), 'max_context' (at `batch`, capped at cfg.max_len)}}.
  """
  if not budget_bytes > 0:
    raise ValueError(f'what_fits: budget_bytes={budget_bytes!r} must be > 0 (e.g. 8 * 2**30).')
  context = context or cfg.max_len
  prompt = prompt or 1
  out = {}
  for name, policy in policies.items():
    formats = layer_formats(cfg, policy)
    total = _total_fn(cfg, policy, formats, prompt, kv)
    fits_total = total(batch, context, compiled)
    out[name] = {
        'weights': weight_bytes(cfg, formats=formats)['total'],
        'total': fits_total, 'fits': fits_total <= budget_bytes,
        'max_batch': _search(
            lambda b, c, total=total: total(b, context, c) <= budget_bytes, max_batch, compiled),
        'max_context': _search(
            lambda s, c, total=total: total(batch, s, c) <= budget_bytes, cfg.max_len, compiled),
        'planner': 'compiled' if compiled else 'estimate'}
  return out


def max_context(cfg: TransformerConfig, budget_bytes: float,
                policy: Optional[QuantPolicy] = None, *, batch: int = 1,
                kv: Optional[QFormat | str] = None, compiled: bool = False) -> int:
  """The longest cache (<= cfg.max_len) whose decode fits `budget_bytes` at `batch` (the
  `max_context` of `what_fits`, without the batch search); 0 if none does."""
  if not budget_bytes > 0:
    raise ValueError(f'max_context: budget_bytes={budget_bytes!r} must be > 0.')
  total = _total_fn(cfg, policy, layer_formats(cfg, policy), 1, kv)
  return _search(lambda s, c: total(batch, s, c) <= budget_bytes, cfg.max_len, compiled)


def _total_fn(cfg, policy, formats, prompt, kv):
  def total(b, s, compiled):
    kw = dict(policy=policy, compiled=True) if compiled else dict(formats=formats)
    return predict(cfg, batch=b, context=s, prompt=min(prompt, s), kv=kv, **kw).total
  return total


def _search(ok_of, hi: int, compiled: bool) -> int:
  """Largest n in [1, hi] with ok_of(n, compiled); compiled probes start from the estimate's
  answer, so they cost ~log2 of the distance, not of hi."""
  guess = _largest(lambda n: ok_of(n, False), 1, hi)
  if not compiled:
    return guess
  ok = functools.lru_cache(maxsize=None)(lambda n: ok_of(n, True))
  if guess and ok(guess):
    return _largest(ok, guess, hi)
  return _largest(ok, 1, max(guess - 1, 1))


# ---------------------------------------------------------------------------- measurement
def _device_bytes(tree) -> int:
  return sum(int(a.nbytes) for a in jax.tree.leaves(tree) if hasattr(a, 'nbytes'))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _step(graphdef, state, tokens_BT, cache):
  logits_BTV, cache = nnx.merge(graphdef, state)(tokens_BT, cache=cache)
  return logits_BTV[:, -1], cache


def _analyse(model, batch: int, tokens: int, context: int) -> dict:
  cfg = model.config
  graphdef, state = nnx.split(model)
  cache = jax.eval_shape(lambda: init_cache(cfg, batch, context, fmt=kv_format(model)))
  toks = jax.ShapeDtypeStruct((batch, tokens), jnp.int32)
  m = _step.lower(graphdef, state, toks, cache).compile().memory_analysis()
  if m is None:
    raise RuntimeError('compiled_memory: this backend gives no memory analysis.')
  return {'temp': int(m.temp_size_in_bytes), 'argument': int(m.argument_size_in_bytes),
          'output': int(m.output_size_in_bytes), 'alias': int(m.alias_size_in_bytes),
          'generated_code': int(m.generated_code_size_in_bytes)}


def compiled_memory(model: nnx.Module, batch: int, tokens: int, context: int) -> dict:
  """XLA's memory analysis of one cached step feeding `tokens` per row into a cache of
  `context` slots (prefill: tokens = prompt; decode: tokens = 1); compiled, not run.

  Returns:
    {'temp', 'argument', 'output', 'alias', 'generated_code'} in bytes.
  """
  return _analyse(model, batch, tokens, context)


def abstract_model(cfg: TransformerConfig, policy: Optional[QuantPolicy] = None,
                   kv: Optional[QFormat | str] = None) -> nnx.Module:
  """The model `quantize_model` would give under `policy` (KV format `kv`), as shapes only:
  `nnx.eval_shape`, so no weight is materialised (an RTN, GPTQ or AWQ conversion in the
  same formats has the same shapes)."""
  def build():
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    if policy is not None:
      model = quantize_model(model, policy)[0]
    return model if kv is None else with_kv_format(model, kv)
  return nnx.eval_shape(build)


@functools.lru_cache(maxsize=64)
def _abstract_for(cfg, policy, kv):
  return abstract_model(cfg, policy, kv)


def compiled_step_bytes(cfg: TransformerConfig, policy: Optional[QuantPolicy] = None, *,
                        batch: int, tokens: int, context: int,
                        kv: Optional[QFormat | str] = None) -> dict:
  """`compiled_memory` of the model `policy` gives, compiled from shapes (`abstract_model`):
  what XLA on this backend will allocate for the step, with no model built."""
  _check_workload(cfg, batch, context)
  try:
    return dict(_compiled_cached(cfg, policy, kv, batch, tokens, context))
  except TypeError:  # an unhashable policy: compile it uncached
    return _analyse(abstract_model(cfg, policy, kv), batch, tokens, context)


@functools.lru_cache(maxsize=256)
def _compiled_cached(cfg, policy, kv, batch, tokens, context):
  return _analyse(_abstract_for(cfg, policy, kv), batch, tokens, context)


def step_activations(analysis: dict) -> int:
  """A compiled step's bytes beyond its arguments: temp + the output not aliased to them."""
  return analysis['temp'] + analysis['output'] - analysis['alias']


def run_step(model: nnx.Module, tokens_BT, cache):
  """Run the step `compiled_memory` analyses (the cache donated): (last logits, cache)."""
  graphdef, state = nnx.split(model)
  return _step(graphdef, state, jnp.asarray(tokens_BT, jnp.int32), cache)


def measure(model: nnx.Module, *, batch: int, context: int, prompt: Optional[int] = None,
            compiled: bool = True) -> dict:
  """Measured memory of `model` for a workload (the counterpart of `predict`).

  Returns:
    {'weights': {'quantized', 'float', 'total'} (device buffers of the state),
     'kv' (an empty cache's buffers), 'prefill' / 'decode' (compiled memory analyses, when
     `compiled`), 'peak_rss', and on an accelerator 'device' (`process.device_memory()`:
     in_use, peak, limit)}.
  """
  cfg = model.config
  _check_workload(cfg, batch, context)
  from qjax.nn import QWeight  # pylint: disable=g-import-not-at-top
  q = _device_bytes(nnx.state(model, QWeight))
  f = _device_bytes(nnx.state(model, nnx.Param))
  out = {'weights': {'quantized': q, 'float': f, 'total': q + f}}
  cache = init_cache(cfg, batch, context, fmt=kv_format(model))
  out['kv'] = _device_bytes(cache)
  del cache
  if compiled:
    out['prefill'] = compiled_memory(model, batch, prompt or context, context)
    out['decode'] = compiled_memory(model, batch, 1, context)
  out['peak_rss'] = process.peak_rss_bytes()
  device = process.device_memory()
  if device is not None:
    out['device'] = device
  return out
