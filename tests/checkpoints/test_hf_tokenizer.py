"""`HFTokenizer`: tokenizer.json with the chat template rendered as transformers renders it."""

import json

import pytest

pytest.importorskip('tokenizers')
pytest.importorskip('jinja2')

from qjax.checkpoints import HFTokenizer  # noqa: E402
import hf_testdata  # noqa: E402

# Features the released templates use (Llama 3.1 / Qwen 2.5 / Mistral): `tools` tested
# against none, `tojson`, loop controls, `{% generation %}`, `strftime_now`, raise_exception.
TEMPLATE = ("{%- if tools is not none %}TOOLS{{ tools | tojson }}{% endif %}"
            "{% for m in messages %}{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
            "{% if m['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
            "{% generation %}<{{ m['role'] }}>{{ m['content'] | tojson }}{% endgeneration %}"
            "{% endfor %}[{{ strftime_now('%Y') | length }}]"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MESSAGES = [{'role': 'user', 'content': 'Hi <b>é</b>'}, {'role': 'skip', 'content': 'x'}]


@pytest.fixture(scope='module')
def directory(tmp_path_factory):
  d = tmp_path_factory.mktemp('tok')
  hf_testdata.write_tokenizer(d, 300)
  return d


def test_template_features_render_like_transformers(directory, tmp_path):
  (tmp_path / 'tokenizer.json').write_bytes((directory / 'tokenizer.json').read_bytes())
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps(
      {'chat_template': [{'name': 'default', 'template': TEMPLATE}], 'eos_token': '<eos>'}))
  tok = HFTokenizer.from_dir(str(tmp_path))
  assert tok.render_chat(MESSAGES) == '<user>"Hi <b>é</b>"[4]<assistant>'
  assert tok.stop_ids == (tok.encode('<eos>', add_special_tokens=False)[0],)
  with pytest.raises(ValueError, match='refused the messages: no bad roles'):
    tok.render_chat([{'role': 'bad', 'content': ''}])


def test_chat_template_file_wins_and_text_round_trips(directory, tmp_path):
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    (tmp_path / name).write_bytes((directory / name).read_bytes())
  (tmp_path / 'chat_template.jinja').write_text('{{ bos_token }}[{{ messages[0].content }}]')
  tok = HFTokenizer.from_dir(str(tmp_path))
  assert tok.render_chat([{'role': 'user', 'content': 'Hi'}]) == '<bos>[Hi]'
  text = 'To be, or not to be: that is the question.'
  assert tok.decode(tok.encode(text)) == text and tok.encode(text)[0] == 1


def test_same_text_and_ids_as_transformers_apply_chat_template(directory):
  transformers = pytest.importorskip('transformers', reason='the comparison needs the '
                                     'reference extra (transformers)')
  ref = transformers.AutoTokenizer.from_pretrained(str(directory))
  tok = HFTokenizer.from_dir(str(directory))
  messages = [{'role': 'user', 'content': 'What is the capital of France?'}]
  assert tok.render_chat(messages) == ref.apply_chat_template(
      messages, tokenize=False, add_generation_prompt=True)
  assert tok.chat(messages[0]['content']) == list(ref.apply_chat_template(
      messages, tokenize=True, add_generation_prompt=True, return_dict=False))
  assert tok.encode('Hello there') == ref('Hello there')['input_ids']
