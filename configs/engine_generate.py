r"""Interactive generation with the serving engine: a prompt in, streamed text out.

The model (Gemma 3 270M, or a random tiny one for a smoke run) is quantized by `weights`
(the embedding / tied LM head stays float: on CPU a quantized 262k-row head is slower than
the float one), served by `qjax.infer.Engine` with the KV cache in `kv_format`, and each
prompt's continuation is printed as it is generated (`Engine.stream_text`).

Command:
  XLA_FLAGS= .venv/bin/python -m experiments.generate --config=configs/engine_generate.py \
      --prompt='To be, or not to be, that is the'
  (without --prompt: reads prompts from stdin, one per line, until EOF; an empty line ends)
  --config.weights=float|int8|int4_g128  --config.kv_format=float|int8|int4
  --config.temperature=0 (greedy)
  A checkpoint written by experiments.convert (its weights and tokenizer; `model` and
  `weights` are then ignored), with its chat template applied to each prompt:
  python -m experiments.generate --config.checkpoint=OUT --config.chat=True --prompt='Hi'
  A checkpoint generates in its own precision unless asked otherwise: the KV cache format it
  was converted with (float when none) and greedy decoding; `model` generates with an int8
  KV cache at temperature 0.7. The first line on stderr says what runs.
  From another directory: python /path/to/qjax/experiments/generate.py ...
Expected run time: ~20 s to load Gemma, ~1 min to quantize and compile the step buckets,
  then ~5-30 tokens/s on 2 CPU cores.
Expected result: with temperature 0 and float weights, "To be, or not to be, that is the"
  continues with " question" (HF transformers gives p = 0.834 for it); the tiny model prints
  random bytes.
"""

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = 'gemma3_270m'          # or 'tiny'
  c.checkpoint = ''                # an experiments.convert output: serve it instead of `model`
  c.chat = False                   # wrap each prompt in the checkpoint's chat template
  c.weights = 'int4_g128'          # 'float', 'int8', 'int4_g128'
  # 'float' or a KV format name; unset: a checkpoint's own (float when it has none), int8
  # for `model`.
  c.kv_format = config_dict.placeholder(str)
  # Unset: 0 (greedy) for a checkpoint, 0.7 for `model`.
  c.temperature = config_dict.placeholder(float)
  c.top_p = 0.95
  c.top_k = 0
  c.repetition_penalty = 1.0
  c.max_tokens = 48
  c.seed = 0
  c.engine = dict(max_batch=1, page_size=16, num_pages=1 + 32, chunk_size=64, max_len=512)
  return c
