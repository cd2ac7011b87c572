"""The GGUF tokenizer builder on a tiny vocabulary (the real one: test_gemma3_270m.py)."""

import pytest

pytest.importorskip('tokenizers')

import gguf_testdata as td  # noqa: E402
from qjax.checkpoints.tokenizer import (build_tokenizer, check_vocab, gguf_tokenizer,  # noqa: E402
                                        merges_from_vocab, respell)


@pytest.fixture(scope='module')
def tok():
  return build_tokenizer(td.TOKENS, td.TYPES, bos_id=2, eos_id=1, unk_id=3, pad_id=0)


def test_respell_only_whitespace_tokens_with_spaces():
  assert respell('  ') == '\u2581\u2581'
  assert respell(' \t') == '\u2581\u2581'
  assert respell('\n\n') == '\n\n' and respell(' a') == ' a'


def test_merges_ranked_by_vocab_position_then_longer_pieces():
  # 'ab' (id 1) merges before 'abc' (id 2); 'abc' splits as ab+c before a+bc.
  assert merges_from_vocab(['a', 'ab', 'abc', 'b', 'c', 'bc']) == [
      ('a', 'b'), ('ab', 'c'), ('a', 'bc'), ('b', 'c')]


def test_encode_bos_merges_bytes_and_specials(tok):
  ids = tok.encode(' abc').ids
  assert ids == [2, td.TOKENS.index('\u2581abc')]
  # Unknown characters fall back to bytes: 'é' = C3 A9.
  assert tok.encode('é').ids == [2, td.TOKENS.index('<0xC3>'), td.TOKENS.index('<0xA9>')]
  # Control and user-defined tokens match whole; the real-space token is respelled.
  assert tok.encode('<start_of_turn>\n\n').ids == [2, 5, td.TOKENS.index('\n\n')]
  assert tok.encode('  ').ids == [2, td.TOKENS.index('  ')]
  assert tok.decode(tok.encode(' abc é\n\n').ids) == ' abc é\n\n'


def test_gguf_tokenizer_from_a_file_and_its_cache(tmp_path):
  cfg = td.tiny_config()
  path = tmp_path / 'tiny.gguf'
  td.write_gguf(path, cfg, td.random_params(cfg))
  cold = gguf_tokenizer(path, cache_dir=tmp_path)
  warm = gguf_tokenizer(path, cache_dir=tmp_path)
  assert list((tmp_path / 'gguf').glob('*/tokenizer.json'))
  assert cold.to_str() == warm.to_str()
  check_vocab(cold, cfg, exact=True)


def test_vocab_mismatch_is_a_clear_error(tok):
  small = td.tiny_config(vocab_size=len(td.TOKENS) - 1)
  with pytest.raises(ValueError, match=r'tokenizer has 275 tokens, the model embeds 274'):
    check_vocab(tok, small)
  check_vocab(tok, td.tiny_config(vocab_size=len(td.TOKENS) + 5))  # padded vocab: fine
  with pytest.raises(ValueError, match='vocabulary mismatch'):
    check_vocab(tok, td.tiny_config(vocab_size=len(td.TOKENS) + 5), exact=True)


def test_non_gemma_gguf_is_a_clear_error(tmp_path):
  cfg = td.tiny_config()
  path = tmp_path / 'llama.gguf'
  td.write_gguf(path, cfg, td.random_params(cfg), arch='llama')
  with pytest.raises(ValueError, match="architecture 'llama' is not supported"):
    gguf_tokenizer(path, cache=False)
