"""Exact blockwise attention for long prefills and perplexity: selection and measurement.

The math lives with the attention layer (`qjax.nn.attention.attend_blockwise`, an online
softmax over key blocks, FlashAttention-style, Dao et al. 2022), because the layer calls it
when `TransformerConfig.attention_impl == 'blockwise'`; `nn` never imports `infer`. This
module switches a built model to it and measures what it saves:

    model = with_attention_impl(model, 'blockwise', block_size=512)   # a copy
    nll = model(tokens_BT)          # cache-free forward: temp memory O(T), not O(T^2)
    attention_temp_bytes(2048, 'blockwise')   # compiled temp bytes of one attention call
    nll_1T = token_nll(model, tokens_1T)   # long-context NLL: logits a chunk at a time
    forward_temp_bytes(model, 32768)       # compiled temp bytes of that, without running it
    bucket_perplexity(nll_1T[0], (0, 512, 1024, 2048))
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import numpy as np

import jax
import jax.numpy as jnp
from flax import nnx

from qjax.nn.attention import Attention, attend, attend_blockwise
from qjax.nn.attention_forms import choose_form, fused_attend
from qjax.nn.config import ATTENTION_IMPLS


def with_attention_impl(model: nnx.Module, impl: str,
                        block_size: Optional[int] = None) -> nnx.Module:
  """A copy of `model` whose attention layers use `impl` ('auto', 'fused', 'dense' or
  'blockwise'; `qjax.nn.layer_forms` says what each then runs).

  Args:
    model: a `Transformer` (float or quantized).
    impl: one of `qjax.nn.config.ATTENTION_IMPLS`.
    block_size: keys per block (default: the config's `attention_block`).

  Returns:
    The copy; its `config` names the implementation too, so records and caches built from it
    agree with what it runs.
  """
  cfg = model.config.replace(attention_impl=impl, **(
      {} if block_size is None else {'attention_block': block_size}))  # validates both
  model = nnx.clone(model)
  model.config = cfg
  layers = [m for _, m in nnx.iter_modules(model) if isinstance(m, Attention)]
  if not layers:
    raise ValueError(f'with_attention_impl: {type(model).__name__} has no Attention layer.')
  for m in layers:
    m.impl, m.block_size = cfg.attention_impl, cfg.attention_block
  return model


def attention_temp_bytes(seq_len: int, impl: str, *, num_heads: int = 4, num_kv_heads: int = 1,
                         head_dim: int = 256, block_size: int = 512,
                         window: Optional[int] = None) -> int:
  """Compiled temp memory (bytes, XLA's memory analysis) of one causal attention call.

  Args:
    seq_len: T = S (a prefill, or a cache-free forward), batch 1.
    impl: one of `ATTENTION_IMPLS`; 'auto' and 'fused' measure the form they run on this
      platform (`qjax.nn.attention_forms.choose_form`).
    num_heads, num_kv_heads, head_dim: N, K, H (defaults: Gemma 3 270M).
    block_size: keys per block of the blockwise path.
    window: sliding window, or None.

  Returns:
    `temp_size_in_bytes` of the compiled function: O(T^2) dense, O(T * block) blockwise.
  """
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f'attention_temp_bytes: impl={impl!r} is unknown; use one of '
                     f'{ATTENTION_IMPLS}.')
  q = jax.ShapeDtypeStruct((1, seq_len, num_heads, head_dim), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, seq_len, num_kv_heads, head_dim), jnp.float32)
  pos = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
  form = choose_form(impl, t=seq_len, dtype=jnp.float32, head_dim=head_dim).name
  if form == 'dense':
    fn = lambda q, k, v, p: attend(q, k, v, p, p, window=window)
  elif form == 'blockwise':
    fn = lambda q, k, v, p: attend_blockwise(q, k, v, p, p, window=window,
                                             block_size=block_size)
  else:  # the fused form `impl` runs on this platform
    fn = lambda q, k, v, p: fused_attend(form, q, k, v, p, p, window=window,
                                         block_size=block_size)
  compiled = jax.jit(fn).lower(q, kv, kv, pos).compile()
  return int(compiled.memory_analysis().temp_size_in_bytes)


def _nll(model, tokens_BT: jax.Array, logits_chunk: int) -> jax.Array:
  b, t = tokens_BT.shape
  positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  x_BTD, _ = model.run_layers(model.embed_tokens(tokens_BT), positions_BT)
  x_BTD, targets_BT = x_BTD[:, :-1], tokens_BT[:, 1:]
  chunk = min(logits_chunk, t - 1)
  pad = -(t - 1) % chunk
  x_BTD = jnp.pad(x_BTD, ((0, 0), (0, pad), (0, 0)))
  targets_BT = jnp.pad(targets_BT, ((0, 0), (0, pad)))
  nc = (t - 1 + pad) // chunk
  x_JBTD = jnp.moveaxis(x_BTD.reshape(b, nc, chunk, -1), 1, 0)
  y_JBT = jnp.moveaxis(targets_BT.reshape(b, nc, chunk), 1, 0)

  def one(xy):  # the T x V logits never exist at once: `chunk` rows of them at a time
    logits_BTV = model.logits(xy[0])
    picked_BT = jnp.take_along_axis(logits_BTV, xy[1][..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits_BTV, axis=-1) - picked_BT
  nll_JBT = jax.lax.map(one, (x_JBTD, y_JBT))
  return jnp.moveaxis(nll_JBT, 0, 1).reshape(b, -1)[:, :t - 1]


@functools.partial(jax.jit, static_argnums=(0, 3))
def _nll_jit(graphdef, state, tokens_BT, logits_chunk):
  return _nll(nnx.merge(graphdef, state), tokens_BT, logits_chunk)


def token_nll(model: nnx.Module, tokens_BT, *, logits_chunk: int = 256) -> jax.Array:
  """Negative log-likelihood of every next token of a cache-free forward, float32 (B, T-1).

  Memory: the blocks' activations are O(T) (with `attention_impl='blockwise'`, attention
  too), and the LM head runs `logits_chunk` positions at a time (`lax.map`), so the T x V
  logits (8192 x 262144 floats = 8.6 GB for Gemma at 8k) never exist at once.

  Args:
    model: a `Transformer` (use `with_attention_impl(model, 'blockwise')` for long T).
    tokens_BT: int token ids, T >= 2.
    logits_chunk: positions per LM-head call.

  Returns:
    nll_BT: entry [b, i] is -log p(tokens[b, i + 1] | tokens[b, :i + 1]).
  """
  tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
  if tokens_BT.ndim != 2 or tokens_BT.shape[1] < 2:
    raise ValueError(f'token_nll: tokens of shape {tokens_BT.shape}; give (B, T) with T >= 2.')
  if not isinstance(logits_chunk, int) or logits_chunk < 1:
    raise ValueError(f'token_nll: logits_chunk={logits_chunk!r} must be a positive integer.')
  graphdef, state = nnx.split(model)
  return _nll_jit(graphdef, state, tokens_BT, logits_chunk)


def forward_temp_bytes(model: nnx.Module, seq_len: int, *, batch: int = 1,
                       logits_chunk: int = 256) -> int:
  """Compiled temp memory (bytes, XLA's memory analysis) of `token_nll` at T = seq_len,
  without running it (so a length too slow to run can still be sized)."""
  graphdef, state = nnx.split(model)
  tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
  fn = jax.jit(functools.partial(_nll_jit.__wrapped__, graphdef), static_argnums=(2,))
  compiled = fn.lower(state, tokens, logits_chunk).compile()
  return int(compiled.memory_analysis().temp_size_in_bytes)


def bucket_perplexity(nll_T, edges: Sequence[int]) -> list[dict]:
  """Perplexity of the predictions in each position bucket [edges[i], edges[i+1]).

  Args:
    nll_T: per-prediction NLL of one sequence (`token_nll(...)[0]`); prediction i is of
      position i + 1.
    edges: increasing bucket edges in prediction index; the last bucket ends at len(nll_T)
      when the last edge is smaller.

  Returns:
    One dict per bucket: start, end, tokens, ppl.
  """
  nll_T = np.asarray(nll_T, np.float64)
  edges = list(edges)
  if edges[-1] < len(nll_T):
    edges.append(len(nll_T))
  if any(b <= a for a, b in zip(edges, edges[1:])) or edges[0] < 0:
    raise ValueError(f'bucket_perplexity: edges={edges} must increase from >= 0.')
  return [dict(start=a, end=b, tokens=int(len(nll_T[a:b])),
               ppl=float(math.exp(nll_T[a:b].mean())))
          for a, b in zip(edges, edges[1:]) if a < len(nll_T)]
