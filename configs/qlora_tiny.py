r"""QLoRA sweep in seconds: a random tiny model (byte tokenizer) on Tiny Shakespeare.

The same points as configs/qlora_gemma3.py (float, the int4 g64 RTN base, QLoRA at two
ranks with merge + re-quantization, a bf16 full fine-tune, and the base-precision sweep:
int8 per channel and int3 g64 RTN bases with rank-8 adapters) on a 2-layer random model, so
tests and colab/qlora.ipynb run the whole pipeline quickly.

Command:
  XLA_FLAGS= .venv/bin/python -m experiments.finetune --config=configs/qlora_tiny.py \
      --config.out_dir=/tmp/qlora_tiny
Expected run time: ~30 s on a 2-core CPU (compiles dominate).
Expected result: the random model's ppl is ~257 (uniform over bytes); the int4 base about
  the same; 20 steps of QLoRA bring it to ~20-40 (the byte unigram level), the merged and
  re-quantized model within a few % of the adapted one; rank 8 trains 2x rank 4's params.
"""

import ml_collections

from configs import qlora_gemma3


def get_config() -> ml_collections.ConfigDict:
  c = qlora_gemma3.get_config()
  c.model_source = 'tiny'
  c.out_dir = 'results/qlora_tiny'
  c.seed = 0
  c.model = ml_collections.ConfigDict(dict(
      d_model=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64, d_ff=128,
      mlp='swiglu', tie_embeddings=True))
  c.data.eval_window = 64
  c.data.eval_windows = 8
  c.data.eval_batch = 8
  c.train.steps = 20
  c.train.batch = 4
  c.train.seq_len = 64
  c.train.lr = 1e-2
  c.train.warmup = 2
  c.train.log_every = 0
  c.full.steps = 20
  c.full.batch = 4
  c.full.seq_len = 64
  c.full.lr = 3e-3
  c.full.warmup = 2
  c.full.log_every = 0
  c.calib.num_sequences = 8
  c.calib.seq_len = 64
  c.quant.group_size = 64
  return c


def sweep() -> list[dict]:
  """The Gemma config's main points, then its base-precision sweep (rank 8 here)."""
  precision = [{'point.kind': kind, **p, **({'lora.rank': 8} if kind == 'qlora' else {})}
               for p in qlora_gemma3.PRECISIONS for kind in ('base', 'qlora')]
  return [{'point.kind': 'float'}, {'point.kind': 'base'}, {'point.kind': 'qlora', 'lora.rank': 4},
          {'point.kind': 'qlora', 'lora.rank': 8}, {'point.kind': 'full'}] + precision
