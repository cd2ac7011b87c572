"""Tiny random HF checkpoints of every family `qjax.checkpoints.load_hf` reads (needs torch and
transformers: the reference extra), and the comparison of qjax against HF on them.

Each spec is a transformers config class, a model class and the options that make the tiny
model exercise what its family adds (sliding windows shorter than the prompts, softcaps that
bite, a query scale other than 1/sqrt(H), RoPE scaling with positions past the original
context); some are saved sharded, in bfloat16 or float16, to exercise the loader's paths.

    python tests/checkpoints/hf_tiny_families.py      # the agreement table of docs/models.md
"""

from __future__ import annotations

import pathlib

import numpy as np

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=128, initializer_range=0.1)
PROMPT_LEN, STEPS = 40, 16

SPECS = {
    'llama': dict(cfg='LlamaConfig', cls='LlamaForCausalLM', kw=dict(rope_theta=10_000.0),
                  save=dict(max_shard_size='60KB')),  # sharded, with an index
    'llama3_rope': dict(
        cfg='LlamaConfig', cls='LlamaForCausalLM',
        kw=dict(max_position_embeddings=256, tie_word_embeddings=True, rope_parameters=dict(
            rope_type='llama3', rope_theta=10_000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=32))),
    'llama_linear': dict(cfg='LlamaConfig', cls='LlamaForCausalLM', kw=dict(
        rope_parameters=dict(rope_type='linear', rope_theta=10_000.0, factor=4.0))),
    'llama_dynamic': dict(cfg='LlamaConfig', cls='LlamaForCausalLM', kw=dict(
        rope_parameters=dict(rope_type='dynamic', rope_theta=10_000.0, factor=2.0))),
    'mistral': dict(cfg='MistralConfig', cls='MistralForCausalLM', kw=dict(sliding_window=8),
                    dtype='bfloat16'),
    'qwen2': dict(cfg='Qwen2Config', cls='Qwen2ForCausalLM',
                  kw=dict(tie_word_embeddings=True, rope_theta=1e6)),
    'qwen2_yarn': dict(cfg='Qwen2Config', cls='Qwen2ForCausalLM', kw=dict(
        rope_parameters=dict(rope_type='yarn', rope_theta=10_000.0, factor=4.0,
                             original_max_position_embeddings=32))),
    'qwen3': dict(cfg='Qwen3Config', cls='Qwen3ForCausalLM', kw=dict(tie_word_embeddings=False),
                  dtype='float16'),
    'gemma2': dict(cfg='Gemma2Config', cls='Gemma2ForCausalLM', kw=dict(
        sliding_window=8, query_pre_attn_scalar=32, final_logit_softcapping=3.0,
        attn_logit_softcapping=2.0)),
    'gemma3_text': dict(cfg='Gemma3TextConfig', cls='Gemma3ForCausalLM', kw=dict(
        sliding_window=8, query_pre_attn_scalar=32,
        layer_types=['sliding_attention', 'sliding_attention', 'full_attention'],
        rope_parameters={
            'full_attention': dict(rope_type='linear', rope_theta=1e6, factor=4.0),
            'sliding_attention': dict(rope_type='default', rope_theta=10_000.0)})),
    'gemma3': dict(cfg='Gemma3Config', cls='Gemma3ForConditionalGeneration', multimodal=True,
                   kw=dict(sliding_window=8, query_pre_attn_scalar=32,
                           layer_types=['sliding_attention', 'sliding_attention',
                                        'full_attention'])),
}
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              image_size=28, patch_size=14)


def build(name: str, out: pathlib.Path, seed: int = 0, **overrides):
  """Save a tiny random HF model of spec `name` (config `overrides`) to `out`; returns the
  float32 HF model."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  spec = SPECS[name]
  torch.manual_seed(seed)
  cfg_cls = getattr(transformers, spec['cfg'])
  text = dict(COMMON, **spec['kw'], **overrides)
  if spec.get('multimodal'):
    cfg = cfg_cls(text_config=text, vision_config=VISION, mm_tokens_per_image=4)
  else:
    cfg = cfg_cls(**text)
  model = getattr(transformers, spec['cls'])(cfg).eval()
  with torch.no_grad():  # norms init to 1 (or 0 for Gemma's 1 + w) and biases to 0: perturb
    for pname, p in model.named_parameters():
      if pname.endswith('norm.weight'):
        p.add_(0.2 * torch.randn_like(p))
      elif pname.endswith('.bias'):
        p.normal_(0.0, 0.2)
  model.to(getattr(torch, spec.get('dtype', 'float32'))).save_pretrained(
      out, **spec.get('save', {}))
  return getattr(transformers, spec['cls']).from_pretrained(
      out, dtype=torch.float32, attn_implementation='eager').eval()


def prompts(vocab: int, seed: int = 0) -> np.ndarray:
  """Two prompts of PROMPT_LEN random ids (past every tiny window and original context)."""
  return np.random.default_rng(seed).integers(1, vocab, (2, PROMPT_LEN)).astype(np.int32)


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    return model(input_ids=torch.from_numpy(tokens).long()).logits.float().numpy()


def hf_greedy(model, tokens: np.ndarray, steps: int) -> np.ndarray:
  """Greedy continuation by full forwards (no HF cache or generation config involved)."""
  for _ in range(steps):
    nxt = hf_logits(model, tokens)[:, -1].argmax(-1).astype(np.int32)
    tokens = np.concatenate([tokens, nxt[:, None]], axis=1)
  return tokens


def compare(name: str, out: pathlib.Path) -> dict:
  """Build `name`, load it with qjax, compare logits and greedy continuations."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from qjax.checkpoints import load_hf  # pylint: disable=g-import-not-at-top
  from qjax.eval import logits  # pylint: disable=g-import-not-at-top
  from qjax.nn import greedy_generate  # pylint: disable=g-import-not-at-top
  hf = build(name, out)
  model, info = load_hf(out)
  tokens = prompts(model.config.vocab_size)
  ref = hf_logits(hf, tokens)
  got = np.asarray(logits(model, tokens))
  std = float(ref.std())
  want = hf_greedy(hf, tokens, STEPS)
  greedy = np.asarray(greedy_generate(model, jnp.asarray(tokens), STEPS))
  return dict(family=name, model_type=info['model_type'], files=len(info['files']),
              source_dtypes=info['source_dtypes'], logits_std=std,
              max_abs_diff=float(np.abs(got - ref).max()),
              rel_diff=float(np.abs(got - ref).max() / std),
              greedy_identical=bool(np.array_equal(greedy, want)), config=model.config)


if __name__ == '__main__':
  import tempfile  # pylint: disable=g-import-not-at-top
  print('| family | model_type | files | source dtype | max abs logit diff / std | '
        'greedy 16 tokens identical |\n|---|---|---|---|---|---|')
  for family in SPECS:
    with tempfile.TemporaryDirectory() as tmp:
      r = compare(family, pathlib.Path(tmp))
    print(f"| {family} | {r['model_type']} | {r['files']} | {','.join(r['source_dtypes'])} | "
          f"{r['rel_diff']:.1e} | {'yes' if r['greedy_identical'] else 'NO'} |", flush=True)
