"""Tiny HF checkpoints written without torch: qjax params under HF names (safetensors from
numpy), a byte-level BPE tokenizer.json trained on a vendored corpus, a chat template."""

import json

import numpy as np

from qjax.checkpoints import hf_config
from qjax.checkpoints.safetensors_io import INDEX_NAME, hf_shapes

# A Gemma-style one-turn template, as tokenizer_config.json carries it.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                 "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                 "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
SPECIAL = ['<pad>', '<bos>', '<eos>', '<start_of_turn>', '<end_of_turn>']


def write_hf(directory, hf_cfg: dict, params: dict, *, dtype=np.float32, shards: int = 1,
             prefix: str = '') -> None:
  """Write qjax params as a HF checkpoint (names and layouts per `hf_shapes`)."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  directory.mkdir(parents=True, exist_ok=True)
  (directory / 'config.json').write_text(json.dumps(hf_cfg))
  tensors = {}
  for name, (shape, key, kind) in hf_shapes(hf_config(hf_cfg)).items():
    w = params[key].reshape(shape[::-1] if kind == 'linear' else shape)
    w = w.T if kind == 'linear' else w
    hf_name = prefix + name[len('model.'):] if name.startswith('model.') and prefix else name
    tensors[hf_name] = np.ascontiguousarray(w.astype(dtype))
  names = sorted(tensors)
  weight_map = {}
  for i in range(shards):
    part = {n: tensors[n] for n in names[i::shards]}
    fname = f'model-{i + 1:05d}-of-{shards:05d}.safetensors' if shards > 1 else 'model.safetensors'
    save_file(part, str(directory / fname))
    weight_map.update({n: fname for n in part})
  if shards > 1:
    (directory / INDEX_NAME).write_text(json.dumps({'metadata': {}, 'weight_map': weight_map}))


def write_tokenizer(directory, vocab_size: int, chat: bool = True) -> None:
  """A byte-level BPE tokenizer.json of `vocab_size` tokens that adds <bos>, trained on Tiny
  Shakespeare, and a tokenizer_config.json (with a chat template when `chat`)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # pylint: disable=g-import-not-at-top
  from qjax.data import corpus  # pylint: disable=g-import-not-at-top
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator([corpus('tinyshakespeare')[:20_000]], trainer)
  tok.post_processor = processors.TemplateProcessing(
      single='<bos> $A', pair='<bos> $A $B', special_tokens=[('<bos>', tok.token_to_id('<bos>'))])
  tok.save(str(directory / 'tokenizer.json'))
  config = {'bos_token': '<bos>', 'eos_token': '<eos>', 'pad_token': '<pad>'}
  if chat:
    config['chat_template'] = CHAT_TEMPLATE
  (directory / 'tokenizer_config.json').write_text(json.dumps(config))
  (directory / 'generation_config.json').write_text(json.dumps(
      {'eos_token_id': [tok.token_to_id('<eos>'), tok.token_to_id('<end_of_turn>')]}))
