"""A small byte-level language model trained on the embedded corpus (`pydoc_data.topics`).

Command:
  .venv/bin/python -m experiments.train --config=configs/tiny_lm.py --config.workdir=/tmp/lm
  (any field can be overridden: --config.train.steps=2000 --config.model.num_layers=6
   --config.data.source=qjax/data/corpora/tinyshakespeare/input.txt)
Expected run time: ~1 minute on an idle 2-core CPU (300 steps of 16 x 128 bytes, 0.5M params).
Expected metric: validation perplexity ~4-6 bytes^-1 (the unigram baseline is ~25-30);
  a rerun after a kill resumes from the latest checkpoint and ends on the same loss.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.workdir = 'results/tiny_lm'

  c.data = ml_collections.ConfigDict()
  c.data.source = 'pydoc_data.topics'    # or a path to any UTF-8 text file
  c.data.seq_len = 128
  c.data.valid_fraction = 0.1

  c.model = ml_collections.ConfigDict()   # qjax.nn.TransformerConfig fields (vocab from data)
  c.model.d_model = 128
  c.model.num_layers = 2
  c.model.num_heads = 2
  c.model.num_kv_heads = 1               # MQA (GQA/MHA by config)
  c.model.head_dim = 128                  # 128 so that group size 128 divides every layer
  c.model.d_ff = 384
  c.model.mlp = 'swiglu'
  c.model.tie_embeddings = True
  c.model.qk_norm = False
  c.model.rope_base = 10_000.0
  c.model.dtype = 'float32'

  c.train = ml_collections.ConfigDict()
  c.train.optimizer = 'adamw'             # any optax optimizer with (lr, b1, b2, weight_decay)
  c.train.steps = 300
  c.train.batch = 16
  c.train.lr = 3e-3
  c.train.warmup = 40
  c.train.weight_decay = 0.1
  c.train.clip_norm = 1.0
  c.train.log_every = 50
  c.train.eval_windows = 64               # validation windows of seq_len for perplexity
  c.train.eval_batch = 16

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 100                # steps between Orbax saves
  c.checkpoint.keep = 2                   # checkpoints kept
  c.checkpoint.allow_config_change = False  # resume with another config/data (recorded in
                                            # provenance.jsonl); refused otherwise
  return c
