"""HF transformers bf16, eager, on the device jax uses: the device check's reference rows.

A row times a prefill forward (last logits only) and `generate` at each batch, as the
difference of two output lengths so the prompt's prefill and the call's setup cancel.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

import jax
import numpy as np

from benchmarks.check_models import Protocol, model_config
from benchmarks.device_env import chip_for


def hf_available() -> Optional[str]:
  """Why HF transformers cannot run here (None: it can, on the same device as jax)."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    return f'not importable ({e.name})'
  if jax.default_backend() == 'gpu' and not torch.cuda.is_available():
    return 'torch sees no GPU'
  return None


def _hf_model(model_name: str, smoke: bool):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  cfg = model_config(model_name, smoke)
  common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, intermediate_size=cfg.d_ff,
                max_position_embeddings=cfg.max_len, tie_word_embeddings=True)
  if model_name == 'llama32_1b':
    hf_cfg, cls = transformers.LlamaConfig(**common, rope_theta=cfg.rope_base), \
        transformers.LlamaForCausalLM
  else:
    hf_cfg, cls = transformers.Gemma3TextConfig(**common, sliding_window=cfg.sliding_window), \
        transformers.Gemma3ForCausalLM
  device = 'cuda' if jax.default_backend() == 'gpu' else 'cpu'
  with torch.device(device):
    model = cls(hf_cfg).to(torch.bfloat16).eval()
  return model, device


def _decode_step_s(model, device: str, vocab: int, b: int, p: Protocol, rng) -> float:
  """Seconds per decode step of `generate` at batch b after a p.prompt-token prompt."""
  import torch  # pylint: disable=g-import-not-at-top
  sync = torch.cuda.synchronize if device == 'cuda' else (lambda: None)

  def gen(n: int) -> float:
    x = torch.tensor(rng.integers(3, vocab, (b, p.prompt)), device=device)
    sync()
    t = time.perf_counter()
    with torch.no_grad():
      model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                     do_sample=False, pad_token_id=0)
    sync()
    return time.perf_counter() - t
  gen(2)
  return max(gen(p.steps) - gen(1), 1e-9) / (p.steps - 1)


def run_hf(model_name: str, p: Protocol, smoke: bool, batches=None) -> dict:
  """HF transformers bf16, eager: prefill forward and `generate` at each of `batches`
  (default the protocol's) on the same device."""
  import torch  # pylint: disable=g-import-not-at-top
  model, device = _hf_model(model_name, smoke)
  cfg = model_config(model_name, smoke)
  sync = torch.cuda.synchronize if device == 'cuda' else (lambda: None)
  rng = np.random.default_rng(0)
  row = {'model': model_name, 'format': 'hf-bf16',
         'description': 'HF transformers bf16, eager, same device',
         'weight_bytes': sum(t.numel() * t.element_size() for t in model.parameters())}
  ids = torch.tensor(rng.integers(3, cfg.vocab_size, (1, p.prefill)), device=device)

  def prefill_once():
    sync()
    t = time.perf_counter()
    with torch.no_grad():
      model(ids, logits_to_keep=1)
    sync()
    return time.perf_counter() - t
  prefill_once()
  row['prefill_tokens'] = p.prefill
  row['prefill_tok_s'] = p.prefill / statistics.median(prefill_once() for _ in range(p.reps))
  chip = chip_for(jax.devices()[0])
  for b in p.batches if batches is None else batches:
    step_s = _decode_step_s(model, device, cfg.vocab_size, b, p, rng)
    row[f'b{b}'] = cell = {'host_loop_ms': 1e3 * step_s, 'host_loop_tok_s': b / step_s}
    if chip is not None:
      cell['hbm_fraction_host_loop'] = row['weight_bytes'] / chip.hbm_bw / step_s
  if device == 'cuda':
    row['device_peak_bytes_so_far'] = int(torch.cuda.max_memory_allocated())
    row['memory_source'] = 'torch.cuda.max_memory_allocated()'
  return row


def decode_cell(model_name: str, b: int, p: Protocol, smoke: bool) -> dict:
  """HF `generate`'s decode step at batch b alone (ms and tokens/s), for a batch the HF row
  did not time."""
  model, device = _hf_model(model_name, smoke)
  vocab = model_config(model_name, smoke).vocab_size
  step_s = _decode_step_s(model, device, vocab, b, p, np.random.default_rng(0))
  return {'host_loop_ms': 1e3 * step_s, 'host_loop_tok_s': b / step_s}
