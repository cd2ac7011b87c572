"""Regenerate the checkpoint goldens from HF transformers (torch, CPU, float32) and compare.

    python scripts/make_reference.py                  # everything (~5 min on 2 cores)
    python scripts/make_reference.py --only=tiny      # tiny Llama/Qwen2/Mistral only (~20 s)
    python scripts/make_reference.py --no-compare     # goldens only, no live qjax comparison

Writes, under tests/testdata/ (small, committed; `make test` reads them without torch):

* hf_tiny/{llama,qwen2,mistral}/: a tiny random model saved with `save_pretrained`
  (config.json + model.safetensors) and golden.npz (token ids, HF float32 logits).
* gemma3_270m/tokenizer_golden.json: HF's GGUF tokenizer ids on a varied text set, and the
  length + sha256 of the ids of the whole Tiny Shakespeare / WikiText-2 valid files.
* gemma3_270m/golden.npz + prompts.json: for >= 8 prompts, HF's prompt ids, 24 greedy ids,
  and per position (prompt + continuation) the top-10 ids, their logits and the logsumexp;
  the same for one 640-token Tiny Shakespeare window (past the 512 sliding window).
* gemma3_270m/reference_report.json (unless --no-compare): the live comparison of qjax with
  HF over the full vocabulary: max |logit diff|, top-1 agreement, qjax's own greedy
  continuations (KV cache) vs HF's, tokenizer JSON identity.

Needs: pip install torch==2.13.0 transformers accelerate gguf (CPU wheel local here).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTDATA = ROOT / 'tests' / 'testdata'
GEMMA_DIR = TESTDATA / 'gemma3_270m'
TOP_K = 10
GREEDY_STEPS = 24
LONG_LEN = 640

PROMPTS = [
    'To be, or not to be, that is the',
    'The capital of France is',
    'def fibonacci(n):\n    if n < 2:\n        return n\n    return',
    'In 1969, 3 astronauts flew 384,400 km; 2 + 2 = 4 and 7 * 8 =',
    'Le café où nous étions était très célèbre pour sa crème brûlée, et',
    'Name    Age\n\tAlice    30\n\tBob      25\n\n\nTotal:',
    'I love pizza 🍕 and sushi 🍣 because they are',
    '東京は日本の首都です。大阪は',
    '<h1>Title</h1>\n<ul>\n  <li>First item</li>\n  <li>',
    'Q: What is the boiling point of water in Fahrenheit?\nA:',
]

TOKENIZER_TEXTS = [
    '', ' ', '  ', 'a', 'Hello, world!', '  leading spaces', 'trailing spaces   ',
    'multiple    spaces\tand\ttabs\n\nand\n\n\nnewlines\r\n',
    'The quick brown fox jumps over the lazy dog.',
    'def f(x):\n    return {"a": [1, 2, 3], \'b\': x ** 2}  # comment\n',
    'for (int i = 0; i < n; ++i) { sum += a[i]; }',
    '3.14159 2.71828 1e-10 -42 +7 1,000,000 12345678901234567890',
    '2024-11-29T12:34:56Z 0x1F 0b1010 007',
    'naïve façade résumé Ångström crème brûlée Ærøskøbing',
    'Größe straße ÇĞİÖŞÜ ñandú', 'Привет, мир! Γειά σου Κόσμε', 'مرحبا بالعالم',
    'नमस्ते दुनिया', '你好，世界。日本語のテキスト。한국어 텍스트',
    'emoji 🍕🍣 👩‍👩‍👧‍👦 🇫🇷 ❤️ 👍🏽', '𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝐛𝐨𝐥𝐝 ∑∫√∞ ≠ ≤',
    'control \x07 bell and \x00 nul and \u200b zero width',
    '<unk> <bos> <eos> <start_of_turn>user\nhi<end_of_turn>\n<pad> <mask>',
    '[multimodal] <unused0> </s> <s>',
    'https://example.com/path?q=1&r=two#frag user@example.org',
    '    indented code\n        more indented\n',
    '"Quotes" \'single\' «guillemets» „low“ —dash– …',
    'ALL CAPS and MiXeD CaSe and snake_case and camelCase',
]


# ----------------------------------------------------------------------------------------
# Tiny random Llama / Qwen2 / Mistral models
# ----------------------------------------------------------------------------------------
TINY = {
    # untied head, GQA 4/2
    'llama': dict(cls='LlamaForCausalLM', cfg='LlamaConfig', dtype='float32', kw=dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        max_position_embeddings=64, tie_word_embeddings=False)),
    # tied head, MQA, q/k/v biases, RoPE base 1e6
    'qwen2': dict(cls='Qwen2ForCausalLM', cfg='Qwen2Config', dtype='float32', kw=dict(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, rms_norm_eps=1e-6,
        max_position_embeddings=64, tie_word_embeddings=True,
        rope_parameters={'rope_type': 'default', 'rope_theta': 1e6})),
    # sliding window 5 (< the 16-token inputs), head_dim 16 != hidden/heads, bf16 weights
    'mistral': dict(cls='MistralForCausalLM', cfg='MistralConfig', dtype='bfloat16', kw=dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        max_position_embeddings=64, tie_word_embeddings=False, sliding_window=5)),
}


def make_tiny(compare: bool) -> None:
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  for name, spec in TINY.items():
    torch.manual_seed(0)
    cfg = getattr(transformers, spec['cfg'])(initializer_range=0.2, **spec['kw'])
    cfg._attn_implementation = 'eager'  # pylint: disable=protected-access
    model = getattr(transformers, spec['cls'])(cfg).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: perturb them so they count
      for pname, p in model.named_parameters():
        if pname.endswith('norm.weight'):
          p.add_(0.2 * torch.randn_like(p))
        elif pname.endswith('.bias'):
          p.normal_(0.0, 0.2)
    out = TESTDATA / 'hf_tiny' / name
    shutil.rmtree(out, ignore_errors=True)
    model.to(getattr(torch, spec['dtype'])).save_pretrained(out)
    for extra in out.iterdir():  # keep only what a loader needs
      if extra.name not in ('config.json', 'model.safetensors'):
        extra.unlink()
    ref = getattr(transformers, spec['cls']).from_pretrained(
        out, dtype=torch.float32, attn_implementation='eager').eval()
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16)).astype(np.int32)
    with torch.no_grad():
      logits = ref(torch.from_numpy(tokens).long()).logits.float().numpy()
    np.savez_compressed(out / 'golden.npz', tokens=tokens, logits=logits)
    msg = f'tiny {name}: {sum(f.stat().st_size for f in out.iterdir()):,} bytes'
    if compare:
      from qjax.checkpoints import safetensors_io  # pylint: disable=g-import-not-at-top
      from qjax.eval import logits as qjax_logits  # pylint: disable=g-import-not-at-top
      qmodel, _ = safetensors_io.load_hf(out)
      diff = np.abs(np.asarray(qjax_logits(qmodel, tokens)) - logits).max()
      msg += f', max |logit diff| qjax vs HF {diff:.2e} (|logits| <= {np.abs(logits).max():.2f})'
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------
# Gemma 3 270M: tokenizer
# ----------------------------------------------------------------------------------------
def ids_digest(ids) -> str:
  return hashlib.sha256(np.asarray(ids, np.int32).tobytes()).hexdigest()


def corpora() -> dict[str, pathlib.Path]:
  """The vendored corpora (qjax.data) the tokenizer goldens cover, by name."""
  from qjax.data import corpus_path  # pylint: disable=g-import-not-at-top
  return {name: corpus_path(name) for name in ('tinyshakespeare', 'wikitext2_valid')}


def make_tokenizer_golden(hf_tok, gguf_path: str, compare: bool) -> dict:
  golden = {'texts': TOKENIZER_TEXTS, 'ids': [hf_tok(t).input_ids for t in TOKENIZER_TEXTS],
            'corpora': {}}
  for name, path in corpora().items():
    ids = hf_tok(path.read_text(encoding='utf-8')).input_ids
    golden['corpora'][name] = {'num_tokens': len(ids), 'sha256': ids_digest(ids),
                               'head': ids[:64]}
  GEMMA_DIR.mkdir(parents=True, exist_ok=True)
  (GEMMA_DIR / 'tokenizer_golden.json').write_text(json.dumps(golden, ensure_ascii=False,
                                                               indent=1))
  report = {}
  if compare:
    from qjax.checkpoints.tokenizer import gguf_tokenizer  # pylint: disable=g-import-not-at-top
    mine = json.loads(gguf_tokenizer(gguf_path, cache=False).to_str())
    theirs = json.loads(hf_tok.backend_tokenizer.to_str())
    report['tokenizer_json_identical_to_hf'] = mine == theirs
    report['tokenizer_json_differing_keys'] = sorted(
        k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
  print(f'tokenizer golden: {len(TOKENIZER_TEXTS)} texts, corpora '
        f'{ {k: v["num_tokens"] for k, v in golden["corpora"].items()} } {report}', flush=True)
  return report


# ----------------------------------------------------------------------------------------
# Gemma 3 270M: logits and greedy continuations
# ----------------------------------------------------------------------------------------
def hf_greedy(model, ids: list[int], steps: int) -> list[int]:
  """Greedy continuation with HF's own KV cache (no EOS stop, no logits processors)."""
  import inspect  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  # transformers >= 5.2x renames `past_key_values` to `cache`; accept either.
  new_api = 'cache' in inspect.signature(model.forward).parameters
  with torch.no_grad():
    out = model(torch.tensor([ids]), use_cache=True)
    new = []
    for _ in range(steps):
      tok = int(out.logits[0, -1].argmax())
      new.append(tok)
      cache = getattr(out, 'cache', None) if new_api else None
      cache = out.past_key_values if cache is None else cache
      kw = {'cache' if new_api else 'past_key_values': cache}
      out = model(torch.tensor([[tok]]), use_cache=True, **kw)
  return new


def hf_logits(model, ids: list[int]) -> np.ndarray:
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    return model(torch.tensor([ids])).logits[0].float().numpy()


def summarize(logits_TV: np.ndarray) -> dict:
  top = np.argsort(-logits_TV, axis=-1, kind='stable')[:, :TOP_K].astype(np.int32)
  m = logits_TV.max(-1, keepdims=True)
  lse = (m[:, 0] + np.log(np.exp(logits_TV - m).sum(-1))).astype(np.float32)
  return {'topk_ids': top, 'topk_logits': np.take_along_axis(logits_TV, top, -1),
          'lse': lse}


def make_gemma_golden(hf_model, hf_tok, gguf_sha: str, compare: bool) -> dict:
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  arrays, meta, full = {}, {'prompts': PROMPTS, 'prompt_ids': [], 'greedy_ids': []}, []
  for i, prompt in enumerate(PROMPTS):
    ids = hf_tok(prompt).input_ids
    greedy = hf_greedy(hf_model, ids, GREEDY_STEPS)
    logits = hf_logits(hf_model, ids + greedy)
    # Teacher-forced argmax = the greedy tokens, unless a near-tie flipped under the cache.
    assert list(logits[len(ids) - 1:-1].argmax(-1)) == greedy, prompt
    for k, v in summarize(logits).items():
      arrays[f'{k}_{i}'] = v
    meta['prompt_ids'].append(ids)
    meta['greedy_ids'].append(greedy)
    full.append(logits)
    print(f'gemma prompt {i}: {len(ids)} ids, greedy {hf_tok.decode(greedy)!r}', flush=True)
  text = corpora()['tinyshakespeare'].read_text(encoding='utf-8')
  long_ids = hf_tok(text).input_ids[:LONG_LEN]
  long_logits = hf_logits(hf_model, long_ids)
  arrays['long_ids'] = np.asarray(long_ids, np.int32)
  for k, v in summarize(long_logits).items():
    arrays[f'long_{k}'] = v
  meta.update(top_k=TOP_K, greedy_steps=GREEDY_STEPS, long_len=LONG_LEN, gguf_sha256=gguf_sha,
              reference=f'transformers {transformers.__version__}, torch {torch.__version__}, '
                        'float32, eager attention, AutoModelForCausalLM(gguf_file=...)')
  np.savez_compressed(GEMMA_DIR / 'golden.npz', **arrays)
  (GEMMA_DIR / 'prompts.json').write_text(json.dumps(meta, ensure_ascii=False, indent=1))
  if not compare:
    return {}
  return compare_gemma(meta, full, long_ids, long_logits)


def compare_gemma(meta, full, long_ids, long_logits) -> dict:
  """Full-vocabulary comparison of qjax with HF's logits, and qjax's own greedy decoding."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from qjax.checkpoints.gemma3 import load_gemma3_270m  # pylint: disable=g-import-not-at-top
  from qjax.eval import logits as qjax_logits  # pylint: disable=g-import-not-at-top
  from qjax.nn import greedy_generate  # pylint: disable=g-import-not-at-top
  model, tok, info = load_gemma3_270m()
  rows = []
  for i, (ids, greedy, ref) in enumerate(zip(meta['prompt_ids'], meta['greedy_ids'], full)):
    ours = np.asarray(qjax_logits(model, np.asarray([ids + greedy]))[0])
    ours_greedy = np.asarray(greedy_generate(model, jnp.asarray([ids]), GREEDY_STEPS))[0]
    rows.append({
        'prompt': i, 'tokens': len(ids) + len(greedy),
        'same_ids': tok.encode(meta['prompts'][i]).ids == ids,
        'max_abs_logit_diff': float(np.abs(ours - ref).max()),
        'top1_identical_every_position': bool((ours.argmax(-1) == ref.argmax(-1)).all()),
        'greedy_identical': ours_greedy[len(ids):].tolist() == greedy})
    print(f'compare {rows[-1]}', flush=True)
  ours = np.asarray(qjax_logits(model, np.asarray([long_ids]))[0])
  long_row = {'tokens': len(long_ids),
              'max_abs_logit_diff': float(np.abs(ours - long_logits).max()),
              'top1_agreement': float((ours.argmax(-1) == long_logits.argmax(-1)).mean())}
  print(f'compare long window {long_row}', flush=True)
  return {'prompts': rows, 'long_window': long_row,
          'max_abs_logit_diff': max(r['max_abs_logit_diff'] for r in rows + [long_row]),
          'qjax_load_seconds': info['seconds'], 'qjax_cache': info['cache']}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--only', choices=('tiny', 'gemma'), default=None)
  ap.add_argument('--no-compare', dest='compare', action='store_false')
  args = ap.parse_args(argv)
  import torch  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(min(2, os.cpu_count() or 1))
  t0 = time.time()
  if args.only in (None, 'tiny'):
    make_tiny(args.compare)
  if args.only in (None, 'gemma'):
    import transformers  # pylint: disable=g-import-not-at-top
    from qjax.checkpoints.gemma3 import gemma3_270m_path  # pylint: disable=g-import-not-at-top
    from qjax.checkpoints.param_cache import sha256_of  # pylint: disable=g-import-not-at-top
    path = pathlib.Path(gemma3_270m_path())
    hf_tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    report = make_tokenizer_golden(hf_tok, str(path), args.compare)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32,
        attn_implementation='eager').eval()
    report.update(make_gemma_golden(hf_model, hf_tok, sha256_of(path), args.compare))
    if args.compare:
      (GEMMA_DIR / 'reference_report.json').write_text(json.dumps(report, indent=1))
      ok = (report['tokenizer_json_identical_to_hf'] and report['max_abs_logit_diff'] <= 1e-2
            and all(r['same_ids'] and r['top1_identical_every_position'] and
                    r['greedy_identical'] for r in report['prompts']))
      print(f"gemma vs HF: max |logit diff| {report['max_abs_logit_diff']:.2e}, "
            f"{'PASS' if ok else 'FAIL'}", flush=True)
      if not ok:
        return 1
  print(f'done in {time.time() - t0:.0f} s')
  return 0


if __name__ == '__main__':
  sys.exit(main())
