"""A parameter cache entry's config: what the file holds, not how an earlier run ran it."""

import dataclasses

from qjax.checkpoints.gguf import cached_config
from qjax.nn import TransformerConfig


def test_cache_entries_restore_the_model_with_todays_run_fields():
  written = TransformerConfig.tiny(attention_impl='dense', attention_block=64)
  fields = {k: v for k, v in dataclasses.asdict(written).items() if k != 'param_dtype'}
  cfg = cached_config(fields, 'bfloat16')
  assert cfg == TransformerConfig.tiny(param_dtype='bfloat16')  # default attention fields
  assert cfg.attention_impl == 'auto' and cfg.attention_block == 512
