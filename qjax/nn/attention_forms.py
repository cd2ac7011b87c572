"""Which attention form a layer runs, decided in one place (`choose_form`), and the fused forms.

`TransformerConfig.attention_impl` names what the user asks for; `choose_form` turns it into
the form that runs on the target's platform (`qjax.target`: the devices the program is
compiled for), with the reason (listed for reports and benchmarks by
`qjax.nn.layer_forms(model, t)`):

| impl | CPU | NVIDIA GPU | TPU |
|---|---|---|---|
| 'auto' (default) | dense | as 'fused' | as 'fused' |
| 'fused' | `sdpa_xla` | `cudnn` (bf16/fp16, H <= 128, 256 on Hopper+, no softcap) | `splash` |
| 'dense' / 'blockwise' | that form | that form | that form |

On a compile-only GPU (`qjax.aot`) 'fused' runs the unfused form: jax checks cuDNN on a
local GPU while tracing, so nothing can compile the cuDNN call without one.

`cudnn` is `jax.nn.dot_product_attention(implementation='cudnn')` (cuDNN's FlashAttention),
`sdpa_xla` the same call with implementation='xla' (exact, dense memory: the CPU and test
stand-in), `splash` the Pallas splash kernel (`qjax.kernels.splash`). Where no fused kernel
takes a call ('unfused': a softcap, f32, a head dim cuDNN lacks) it runs dense up to
`DENSE_MAX_T` queries and blockwise beyond. Query scaling is already folded into the queries
(`Attention`), so every form is called with scale 1.

cuDNN and splash mask by index (query i sees keys j <= i), which equals qjax's positional mask
when the keys are the queries' own at consecutive positions. `fused_attend` therefore checks
that at run time (`lax.cond`) and otherwise runs the blockwise scan over the given keys, so it
is exact for any positions (padding after the real tokens keeps the fused branch).
Decode (T = 1) runs dense (one query row is O(S) in every form), and on a GPU as 'reduce'
(`attention_core.attend_reduce`): the dense dots take (B, K) as batch dims, which XLA:GPU
wants major-most, so it transposes the (B, S, K, H) cache in and out every step; products
summed in place read it once. On a CPU the dots are faster, on a TPU both read the same bytes.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import jax
import jax.numpy as jnp

from qjax import target as qjax_target
from qjax.nn import attention_core

_LOG = logging.getLogger('qjax.nn.attention_forms')
# cuDNN's fused attention: the largest head dim it takes in every cuDNN 9 release, and from
# Hopper (compute capability 9.0) on, as jax's own check has it (`check_is_flash_attention` in
# jax._src.cudnn.fused_attention_stablehlo, jax 0.10 to 0.12): Gemma 3's 256 fuses there.
CUDNN_MAX_HEAD_DIM = 128
CUDNN_MAX_HEAD_DIM_HOPPER = 256
# Where no fused kernel applies, the longest T that runs dense (what 'dense' ran before the
# fused forms): its T x S logits are 16 MiB per head at T = S = 1024; longer runs blockwise.
DENSE_MAX_T = 1024


@dataclasses.dataclass(frozen=True)
class Form:
  """The attention form a call runs and why."""

  name: str
  reason: str


def cudnn_max_head_dim(capability: Optional[tuple[int, int]]) -> int:
  """The largest head dim cuDNN's fused attention takes on a GPU of `capability`."""
  hopper = capability is not None and tuple(capability) >= (9, 0)
  return CUDNN_MAX_HEAD_DIM_HOPPER if hopper else CUDNN_MAX_HEAD_DIM


def choose_form(impl: str, *, t: int, dtype, head_dim: int,
                logit_softcap: Optional[float] = None,
                on: Optional[str] = None,
                capability: Optional[tuple[int, int]] = None) -> Form:
  """The form an attention call of T queries runs, and why (see the module docstring).

  Args:
    impl: 'auto', 'fused', 'dense' or 'blockwise' (`TransformerConfig.attention_impl`).
    t: T, queries per row.
    dtype: the queries' dtype.
    head_dim: H.
    logit_softcap: the attention logit softcap, or None.
    on: the platform (the target's, `qjax.target.platform()`, when None).
    capability: the NVIDIA GPU's compute capability (the target's when None; unknown counts
      as before Hopper).

  Returns:
    A Form.
  """
  target = qjax_target.current()
  on = on or target.platform
  if t == 1:
    if on in ('nvidia', 'rocm'):
      return Form('reduce', 'decode on a GPU: products summed in place read the cache in its '
                  'own layout (the dense dots make XLA:GPU transpose it in and out every step)')
    return Form('dense', 'decode: one query row costs O(S) in every form')
  if impl == 'auto':
    if on == 'cpu':
      return Form('dense', "impl 'auto' on CPU: XLA:CPU has no fused attention")
    impl = 'fused'
  if impl in ('dense', 'blockwise'):
    return Form(impl, f'impl {impl!r}')
  if impl != 'fused':
    raise ValueError(f"choose_form: impl={impl!r} is unknown; use 'auto', 'fused', 'dense' "
                     "or 'blockwise'.")
  if on == 'tpu':
    return Form('splash', 'TPU: Pallas splash attention')
  if on == 'nvidia':
    why = []
    if logit_softcap is not None:
      why.append(f'logit softcap {logit_softcap}')
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
      why.append(f'dtype {jnp.dtype(dtype).name} (cuDNN takes bf16/fp16)')
    max_head_dim = cudnn_max_head_dim(capability or target.compute_capability)
    if head_dim > max_head_dim or head_dim % 8:
      why.append(f'head_dim {head_dim} (cuDNN takes multiples of 8 up to {max_head_dim} on '
                 'this GPU)')
    if why:
      return _unfused(t, 'cuDNN flash attention cannot take ' + ', '.join(why))
    if target.compile_only and on == target.platform:
      # jax checks cuDNN's version and the GPU on a local GPU backend while tracing.
      return _unfused(t, 'NVIDIA: cuDNN flash attention on the device; a compile-only GPU '
                      '(qjax.aot) has no cuDNN for jax to check, so its program stands in')
    return Form('cudnn', 'NVIDIA: cuDNN flash attention')
  if logit_softcap is not None:
    return _unfused(t, 'jax.nn.dot_product_attention has no logit softcap')
  return Form('sdpa_xla', f"{on}: jax.nn.dot_product_attention(implementation='xla')")


def _unfused(t: int, why: str) -> Form:
  """Where no fused kernel takes a call: dense up to DENSE_MAX_T queries, else blockwise."""
  if t <= DENSE_MAX_T:
    return Form('dense', f'{why}; T = {t} <= {DENSE_MAX_T}: dense')
  return Form('blockwise', f'{why}; T = {t} > {DENSE_MAX_T}: blockwise (O(T) memory)')


def _aligned(q_pos_BT: jax.Array, k_pos_BS: jax.Array, from_zero: bool) -> jax.Array:
  """Whether keys are the queries' own at consecutive positions (padding only at the end)."""
  t = q_pos_BT.shape[1]
  real_BT = q_pos_BT < attention_core.EMPTY_POSITION
  want_BT = q_pos_BT[:, :1] + jnp.arange(t, dtype=q_pos_BT.dtype)[None]
  ok = jnp.all(jnp.where(real_BT, q_pos_BT == want_BT, True))
  ok &= jnp.all(real_BT[:, :-1] | ~real_BT[:, 1:])  # no real token after a padding one
  if from_zero:
    ok &= jnp.all(q_pos_BT[:, 0] == 0)
  if k_pos_BS is not None:
    ok &= k_pos_BS.shape == q_pos_BT.shape and jnp.all(k_pos_BS == q_pos_BT)
  return ok


def fused_attend(form: str, q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                 q_pos_BT: jax.Array, k_pos_BS: jax.Array, *, own=None,
                 window: Optional[int] = None, logit_softcap: Optional[float] = None,
                 block_size: int = 512, interpret: bool = False) -> jax.Array:
  """Attention in a fused form ('sdpa_xla', 'cudnn' or 'splash'), exact for any positions.

  Args:
    form: the fused form (`choose_form`).
    q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, window, logit_softcap: as
      `qjax.nn.attention_core.attend` (queries already scaled).
    own: None when k/v are the queries' own (a cache-free forward), else (k_BTKH, v_BTKH) of
      this call's new tokens (a prefill against a cache): the index-masked forms then run
      over those when the row starts at position 0, so the cache holds nothing else it sees.
    block_size: keys per block of the blockwise fallback.
    interpret: run a Pallas kernel in interpret mode (tests on CPU).

  Returns:
    out_BTNH in q's dtype.
  """
  kw = dict(window=window, logit_softcap=logit_softcap)
  if form == 'sdpa_xla':
    k_pos_BS = jnp.broadcast_to(k_pos_BS, (q_pos_BT.shape[0], k_pos_BS.shape[1]))
    mask_B1TS = attention_core.attention_mask(q_pos_BT, k_pos_BS, window)[:, None]
    dt = q_BTNH.dtype
    out = jax.nn.dot_product_attention(q_BTNH, k_BSKH.astype(dt), v_BSKH.astype(dt),
                                       mask=mask_B1TS, scale=1.0, implementation='xla')
    return out.astype(dt)
  if form not in ('cudnn', 'splash'):
    raise ValueError(f"fused_attend: form={form!r} is not fused; use 'sdpa_xla', 'cudnn' or "
                     "'splash'.")
  k_own, v_own = (k_BSKH, v_BSKH) if own is None else own

  def fused(q, k, v):
    if form == 'splash':
      from qjax.kernels import splash  # pylint: disable=g-import-not-at-top
      return splash.splash_attention(q, k, v, interpret=interpret, **kw)
    dt = q.dtype
    try:
      return jax.nn.dot_product_attention(
          q, k.astype(dt), v.astype(dt), scale=1.0, is_causal=True, implementation='cudnn',
          local_window_size=None if window is None else (window - 1, 0)).astype(dt)
    except (ValueError, NotImplementedError, RuntimeError) as e:
      # cuDNN checks shapes, layouts and its own version while the call is traced; a call it
      # refuses runs the scan over the same keys (exact: this branch has aligned positions).
      _LOG.warning('cuDNN attention refused %s x %s (%s); running blockwise.', q.shape,
                   k.shape, e)
      return attention_core.attend_blockwise(q, k, v, q_pos_BT, q_pos_BT, block_size=block_size,
                                        **kw)

  def scan(q, k, v):
    return attention_core.attend_blockwise(q, k, v, q_pos_BT, k_pos_BS, block_size=block_size, **kw)

  aligned = _aligned(q_pos_BT, k_pos_BS if own is None else None, own is not None)
  return jax.lax.cond(aligned, lambda: fused(q_BTNH, k_own, v_own),
                      lambda: scan(q_BTNH, k_BSKH, v_BSKH))
