"""The Gemma tokenizer from a GGUF's vocabulary, built with the `tokenizers` library.

    tok = gguf_tokenizer(path)          # a `tokenizers.Tokenizer`; cached as JSON by sha256
    ids = tok.encode('To be, or not to be').ids       # [2, 2021, 577, ...]: BOS first
    check_vocab(tok, model.config)      # ValueError if ids could fall outside the embedding

The GGUF holds a SentencePiece-style vocabulary (tokens, scores, types) and no merges. The
build reproduces HF transformers' GGUF path for Gemma (`gemma_tokenizer` in
`transformers/integrations/gguf/gguf_tokenizer_mapping.py` + `GemmaTokenizer`), so the ids
are HF's, the reference here:

* a BPE model with byte fallback; the normalizer writes spaces as U+2581, no prefix space;
* whitespace-only tokens stored with real spaces are respelled with U+2581;
* merges are recovered from the vocabulary: every split of a token into two vocabulary
  tokens, ranked by the token's position in the file (Gemma's scores do not follow merge
  order), then by longer left and right pieces;
* CONTROL tokens (and HF's named specials, `<mask>` included) match whole as special tokens,
  USER_DEFINED tokens (newline runs, `[multimodal]`, ...) match whole as plain tokens;
* BOS is prepended when the file says `add_bos_token` (Gemma: yes).

Where llama.cpp's tokenizer differs (WikiText-2's literal `<unk>` is spelled out by
llama.cpp, mapped to id 3 here, as by HF) we follow HF. No torch or transformers at run time.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

from qjax.checkpoints import param_cache
from qjax.checkpoints.gguf import architecture, meta_value, open_gguf

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp types
_SPACE = '\u2581'


def respell(token: str) -> str:
  """A whitespace-only token holding a real space -> that many U+2581 (HF's Gemma fix)."""
  return _SPACE * len(token) if ' ' in token and not token.strip() else token


def merges_from_vocab(tokens: Sequence[str]) -> list[tuple[str, str]]:
  """BPE merges implied by a vocabulary ranked by position (HF's `generate_merges`)."""
  vocab = {t: i for i, t in enumerate(tokens)}
  rank = {t: -i for i, t in enumerate(tokens)}
  merges = []
  for token, score in rank.items():
    local = [(token[:k], token[k:], score) for k in range(1, len(token))
             if token[:k] in vocab and token[k:] in vocab]
    local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.extend(local)
  merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
  return [(a, b) for a, b, _ in merges]


def build_tokenizer(tokens: Sequence[str], token_types: Sequence[int], *, bos_id: int,
                    eos_id: int, unk_id: int, pad_id: Optional[int] = None,
                    add_bos: bool = True, add_eos: bool = False):
  """A `tokenizers.Tokenizer` for a Gemma SentencePiece vocabulary (module docstring).

  Args:
    tokens: the vocabulary, id order.
    token_types: llama.cpp token types, one per token.
    bos_id, eos_id, unk_id, pad_id: special token ids.
    add_bos, add_eos: what `encode` adds around a sequence.

  Returns:
    The tokenizer.
  """
  # pylint: disable=g-import-not-at-top
  from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
  from tokenizers import processors
  from tokenizers.models import BPE
  # pylint: enable=g-import-not-at-top
  if len(tokens) != len(token_types):
    raise ValueError(f'tokenizer: {len(tokens)} tokens but {len(token_types)} token types.')
  spelled = [respell(t) for t in tokens]
  vocab = {t: i for i, t in enumerate(spelled)}
  unk = tokens[unk_id]
  tok = Tokenizer(BPE(vocab=vocab, merges=merges_from_vocab(spelled), unk_token=unk,
                      fuse_unk=True, byte_fallback=True, dropout=None))
  tok.normalizer = normalizers.Replace(' ', _SPACE)
  tok.pre_tokenizer = pre_tokenizers.Split(' ', behavior='merged_with_previous', invert=False)
  tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, ' '), decoders.ByteFallback(),
                                   decoders.Fuse()])
  named = [tokens[i] for i in (unk_id, bos_id, eos_id, pad_id) if i is not None]
  if '<mask>' in vocab:  # HF's GemmaTokenizer declares it special
    named.append('<mask>')
  control = [t for t, ty in zip(tokens, token_types) if ty == CONTROL]
  tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                          for t in dict.fromkeys(named + control)])
  tok.add_tokens([AddedToken(t, normalized=False, special=False)
                  for t, ty in zip(tokens, token_types) if ty == USER_DEFINED and t in vocab])
  bos, eos = tokens[bos_id], tokens[eos_id]
  single = ([f'{bos}:0'] if add_bos else []) + ['$A:0'] + ([f'{eos}:0'] if add_eos else [])
  pair = single + ([f'{bos}:1'] if add_bos else []) + ['$B:1'] + (
      [f'{eos}:1'] if add_eos else [])
  specials = ([(bos, bos_id)] if add_bos else []) + ([(eos, eos_id)] if add_eos else [])
  tok.post_processor = processors.TemplateProcessing(single=' '.join(single),
                                                     pair=' '.join(pair),
                                                     special_tokens=specials)
  return tok


def gguf_tokenizer(path: os.PathLike, *, cache: bool = True,
                   cache_dir: Optional[os.PathLike] = None, reader=None):
  """The tokenizer stored in a Gemma GGUF, as a `tokenizers.Tokenizer`.

  Args:
    path: the .gguf file.
    cache: read/write the built tokenizer (JSON) under the cache, keyed by the file's sha256.
    cache_dir: cache root (default $QJAX_CACHE_DIR or ~/.cache/qjax).
    reader: `open_gguf(path)` if the caller already has it (opening parses the whole file).

  Returns:
    The tokenizer; `encode(text).ids` starts with BOS when the file asks for it.

  Raises:
    ValueError: not a Gemma SentencePiece vocabulary, or an unreadable file.
  """
  from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise ValueError(f'GGUF file {path!r} does not exist.')
  entry = param_cache.entry_dir('gguf', param_cache.sha256_of(path), cache_dir) / 'tokenizer.json'
  if cache and entry.is_file():
    try:
      return Tokenizer.from_file(str(entry))
    except Exception as e:  # pylint: disable=broad-except
      # A damaged cache entry must not block loading: rebuild it from the GGUF.
      print(f'qjax: ignoring unreadable cache entry {entry} ({e!r}); rebuilding it.')
  reader = reader if reader is not None else open_gguf(path)
  architecture(reader)
  meta = lambda key, default=KeyError: meta_value(reader, f'tokenizer.ggml.{key}', default)
  if meta('model') != 'llama':
    raise ValueError(f"GGUF tokenizer model {meta('model')!r} is not supported: qjax builds "
                     "Gemma's SentencePiece-style ('llama') vocabulary only.")
  tok = build_tokenizer(
      meta('tokens'), meta('token_type'), bos_id=int(meta('bos_token_id')),
      eos_id=int(meta('eos_token_id')), unk_id=int(meta('unknown_token_id')),
      pad_id=meta('padding_token_id', None), add_bos=bool(meta('add_bos_token', True)),
      add_eos=bool(meta('add_eos_token', False)))
  if cache:
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_suffix(f'.tmp{os.getpid()}')
    tok.save(str(tmp))
    os.replace(tmp, entry)
  return tok


def check_vocab(tokenizer, config, *, exact: bool = False) -> None:
  """Raise ValueError when the tokenizer can emit ids the model has no embedding for.

  Args:
    tokenizer: a `tokenizers.Tokenizer`.
    config: the model's TransformerConfig.
    exact: also require equal sizes (a GGUF's tokenizer and embedding come from one file).
  """
  n = tokenizer.get_vocab_size(with_added_tokens=True)
  if n > config.vocab_size or (exact and n != config.vocab_size):
    raise ValueError(f'tokenizer/model vocabulary mismatch: the tokenizer has {n:,} tokens, '
                     f'the model embeds {config.vocab_size:,}; load both from the same '
                     'checkpoint.')
