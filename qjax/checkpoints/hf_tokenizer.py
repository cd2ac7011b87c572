"""The tokenizer that travels with a HF checkpoint: `tokenizer.json`, and its chat template.

    tok = HFTokenizer.from_dir('path/to/dir')        # a HF directory or a convert output
    ids = tok.encode('Hello')                         # with the tokenizer's own BOS rule
    ids = tok.chat('Hello')                           # the chat template, rendered then encoded
    text = tok.decode(ids)

The chat template is read from `chat_template.jinja` (what transformers 5 saves) or the
`chat_template` entry of `tokenizer_config.json` (a string, or a list of named templates of
which 'default' is taken), and rendered with jinja2 the way transformers renders it (a
sandboxed environment, `trim_blocks` and `lstrip_blocks`, loop controls, a `tojson` that does
not escape HTML, `raise_exception` and `strftime_now`, `{% generation %}` blocks rendered as
their body, `tools=None`, `add_generation_prompt=True`, the special tokens as variables).
The rendered text already holds the BOS the template writes, so it is encoded without the
tokenizer's special tokens.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional, Sequence

# What a HF directory holds about its tokenizer; `copy_tokenizer` copies those present.
TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja',
                   'special_tokens_map.json', 'generation_config.json')


def copy_tokenizer(source: str, dest: str) -> list[str]:
  """Copy the tokenizer files of HF directory `source` that exist into `dest`; their names."""
  os.makedirs(dest, exist_ok=True)
  copied = []
  for name in TOKENIZER_FILES:
    if _present(os.path.join(source, name)):
      shutil.copyfile(os.path.join(source, name), os.path.join(dest, name))
      copied.append(name)
  return copied


def _present(path: str) -> bool:
  """Whether tokenizer file `path` is there; one that is there but is not a regular file (a
  FIFO would block its reader forever; a dangling link) is refused, never skipped."""
  if not os.path.lexists(path):
    return False
  from qjax.checkpoints.safetensors_io import regular_file  # pylint: disable=g-import-not-at-top
  regular_file(path)
  return True


def _read_json(path: str) -> dict:
  if not _present(path):
    return {}
  try:
    with open(path, encoding='utf-8') as fh:
      value = json.load(fh)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f'{path}: not valid JSON ({e}); copy it again from the HF '
                     'checkpoint.') from None
  if not isinstance(value, dict):
    raise ValueError(f'{path}: holds a JSON {type(value).__name__}, not an object; copy it '
                     'again from the HF checkpoint (or delete it: it is optional).')
  return value


def _token_text(value) -> Optional[str]:
  """A special token as tokenizer_config.json writes it (a string or an AddedToken dict)."""
  if isinstance(value, dict):
    return value.get('content')
  return value if isinstance(value, str) else None


def _generation_block():
  """A jinja2 extension rendering `{% generation %}...{% endgeneration %}` as its body (the
  tag transformers uses to mark assistant text for training masks)."""
  from jinja2 import nodes  # pylint: disable=g-import-not-at-top
  from jinja2.ext import Extension  # pylint: disable=g-import-not-at-top

  class GenerationBlock(Extension):
    tags = {'generation'}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(['name:endgeneration'], drop_needle=True)
      return nodes.Scope(body, lineno=lineno)

  return GenerationBlock


class HFTokenizer:
  """A `tokenizers.Tokenizer` with the HF directory's chat template and end-of-turn ids.

  Attributes:
    name: where it was read from (recorded in conversion records).
    chat_template: the jinja template source, or None.
    stop_ids: token ids that end a reply (generation_config.json's eos_token_id, else the
      tokenizer's eos token).
  """

  def __init__(self, tokenizer, directory: str):
    self._tok = tokenizer
    self.name = f'tokenizer.json of {directory}'
    config = _read_json(os.path.join(directory, 'tokenizer_config.json'))
    self.special = {k: _token_text(v) for k, v in config.items()
                    if k.endswith('_token') and _token_text(v) is not None}
    template = config.get('chat_template')
    if isinstance(template, list):  # [{'name': 'default', 'template': ...}, ...]
      named = {t.get('name'): t.get('template') for t in template if isinstance(t, dict)}
      template = named.get('default')
    jinja_path = os.path.join(directory, 'chat_template.jinja')
    if _present(jinja_path):
      with open(jinja_path, encoding='utf-8') as fh:
        template = fh.read()
    self.chat_template: Optional[str] = template if isinstance(template, str) else None
    eos = _read_json(os.path.join(directory, 'generation_config.json')).get('eos_token_id')
    if eos is None and self.special.get('eos_token') is not None:
      eos = self._tok.token_to_id(self.special['eos_token'])
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    self.stop_ids: tuple[int, ...] = tuple(int(i) for i in eos)

  @classmethod
  def from_dir(cls, directory: str) -> 'HFTokenizer':
    """The tokenizer of a HF checkpoint directory or of a convert output.

    Raises:
      ValueError: the directory has no tokenizer.json (naming what it holds).
    """
    from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
    path = os.path.join(directory, 'tokenizer.json')
    if not _present(path):
      held = sorted(os.listdir(directory)) if os.path.isdir(directory) else 'nothing'
      raise ValueError(f'{directory!r} has no tokenizer.json (it holds {held}); '
                       'qjax reads the fast-tokenizer file that HF checkpoints ship: copy it '
                       'from the checkpoint the model came from.')
    return cls(Tokenizer.from_file(path), directory)

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size()

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def render_chat(self, messages: Sequence[dict]) -> str:
    """The chat template rendered for `messages` ({'role', 'content'} dicts), with the
    assistant's turn opened.

    Raises:
      ValueError: the tokenizer has no chat template (a base model): name the fix.
    """
    if self.chat_template is None:
      raise ValueError(f'{self.name}: no chat template (neither chat_template.jinja nor a '
                       "'chat_template' in tokenizer_config.json): a base model; run without "
                       '--config.chat=True or use the instruction-tuned checkpoint.')
    import datetime  # pylint: disable=g-import-not-at-top
    import jinja2.ext  # pylint: disable=g-import-not-at-top
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # pylint: disable=g-import-not-at-top

    def raise_exception(message):
      raise ValueError(f'{self.name}: the chat template refused the messages: {message}')

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
      return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                        sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_block(), jinja2.ext.loopcontrols])
    env.filters['tojson'] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env.from_string(self.chat_template).render(
        messages=list(messages), tools=None, documents=None, add_generation_prompt=True,
        **self.special)

  def chat(self, prompt: str, system: Optional[str] = None) -> list[int]:
    """Token ids of a one-turn chat: `prompt` as the user's message, the reply to follow."""
    messages = ([{'role': 'system', 'content': system}] if system else []) + [
        {'role': 'user', 'content': prompt}]
    return self.encode(self.render_chat(messages), add_special_tokens=False)
