r"""Where a speculative round's time goes, and what cheaper drafts buy (one process, side by side).

  python -m benchmarks.speculative_bench [--model=tiny|gemma3_270m] [--drafts=int8,skip1]
  python -m benchmarks.speculative_bench --mode=drafts --model=gemma3_270m --skip=6 \
      --distill_minutes=20 --drafts=int4_g128,int4_g128+head8192,skip6,skip6d,skip6d+head8192

--mode=cost (default): for each draft and gamma it prints c = draft step / target step and
v = verification pass of gamma + 1 tokens / target step (measured side by side in one
process, warm, median of 5), and the speedup the round would give at the measured alpha:
tokens per pass / (gamma c + v). On an accelerator's memory-bound decode v ~ 1 (Leviathan et
al.'s model); on a compute-bound CPU v approaches gamma + 1.

--mode=drafts: (1) distils the first `--skip` layers + head into `skip<k>d`
(`qjax.pipeline.draft.distill_layer_skip`, logit KL at T=1 on Tiny Shakespeare's train part
after the prompts' first 200k characters, `speculative_sweep.train_text`) for
`--distill_minutes` (or reuses `<out_dir>/skip<k>_distilled.npz` with --distill_minutes=0),
printing the teacher-forced agreement 1 - E[TV] at T=0 / T=1 before and after on held-out
windows (Tiny Shakespeare's validation tail, WikiText-2); (2) for every draft in --drafts
(names of `speculative_sweep.make_draft`, '+head<K>' = truncated-vocabulary head over the K
most frequent training tokens) and temperature, `speculative_sweep.run_point` at --gamma:
plain vs speculative decoding of the same prompts, alpha, c, predicted and measured speedup.
Timings taken on a shared machine are only ratios.
"""

import os
import time

from absl import app
from absl import flags
import numpy as np
from flax import nnx

from qjax.infer import SamplingParams, speculative_generate
from qjax.pipeline import speculative_sweep
from qjax.pipeline import draft as qdraft
from qjax.nn import Transformer, TransformerConfig

_MODE = flags.DEFINE_enum('mode', 'cost', ['cost', 'drafts'], 'what to measure (docstring)')
_MODEL = flags.DEFINE_string('model', 'tiny', "'tiny' (random) or 'gemma3_270m'")
_DRAFTS = flags.DEFINE_string('drafts', 'int8,int4_g32,skip1', 'draft names (make_draft)')
_GAMMAS = flags.DEFINE_string('gammas', '1,2,4', 'draft tokens per pass (cost mode)')
_GAMMA = flags.DEFINE_integer('gamma', 4, 'draft tokens per pass (drafts mode)')
_TEMPS = flags.DEFINE_string('temperatures', '0,1.0', 'temperatures (drafts mode)')
_TOKENS = flags.DEFINE_integer('max_tokens', 16, 'tokens generated per prompt')
_SKIP = flags.DEFINE_integer('skip', 6, 'layers of the distilled draft (drafts mode)')
_MINUTES = flags.DEFINE_float('distill_minutes', 20.0, 'distillation budget; 0: load it')
_LR = flags.DEFINE_float('learning_rate', 2e-4, 'distillation AdamW learning rate')
_BATCH = flags.DEFINE_integer('batch', 2, 'distillation windows per step')
_SEQ = flags.DEFINE_integer('seq_len', 64, 'distillation window length')
_OUT = flags.DEFINE_string('out_dir', 'results/speculative_drafts', 'where the draft is saved')


def _load():
  if _MODEL.value == 'tiny':
    target = Transformer(TransformerConfig.tiny(max_len=128), rngs=nnx.Rngs(0))
    return target, lambda s: np.frombuffer(s.encode(), np.uint8).astype(np.int32)
  from qjax.checkpoints import load_gemma3_270m  # pylint: disable=g-import-not-at-top
  target, tok, _ = load_gemma3_270m()
  return target, lambda s: np.asarray(tok.encode(s).ids, np.int32)


def cost_table(target, encode):
  prompts_BT = speculative_sweep.corpus_prompts(encode, 1, 16)
  step = speculative_sweep.step_seconds(target, prompts_BT)
  print('| draft | gamma | alpha | tokens / pass | c (draft / target step) | '
        'v (verify / target step) | round speedup |')
  print('|---|---|---|---|---|---|---|')
  for name in _DRAFTS.value.split(','):
    draft = speculative_sweep.make_draft(target, name)
    c = speculative_sweep.step_seconds(draft, prompts_BT) / step
    for gamma in [int(g) for g in _GAMMAS.value.split(',')]:
      v = speculative_sweep.step_seconds(target, prompts_BT, num_tokens=gamma + 1) / step
      _, st = speculative_generate(target, draft, prompts_BT, _TOKENS.value, gamma=gamma,
                                   params=SamplingParams(temperature=0.0))
      print(f'| {name} | {gamma} | {st.alpha:.3f} | {st.tokens_per_pass:.2f} | {c:.2f} | '
            f'{v:.2f} | {st.tokens_per_pass / (gamma * c + v):.2f} |')


def _heldout_windows(encode, n: int = 4, length: int = 64) -> np.ndarray:
  from qjax import data  # pylint: disable=g-import-not-at-top
  ts = data.corpus('tinyshakespeare')
  out = []
  for text in (ts[int(len(ts) * 0.9):], data.corpus('wikitext2_valid')[200_000:]):
    ids = encode(text[:100_000])
    out += [ids[s:s + length] for s in np.linspace(0, ids.size - length - 1, n).astype(int)]
  return np.stack(out)


def draft_study(target, encode):
  os.makedirs(_OUT.value, exist_ok=True)
  train_ids = encode(speculative_sweep.train_text())
  windows = _heldout_windows(encode)
  k, path = _SKIP.value, speculative_sweep.distilled_path(_OUT.value, _SKIP.value)
  print(f'load average {os.getloadavg()[0]:.1f}; {train_ids.size} training tokens', flush=True)
  plain = speculative_sweep.make_draft(target, f'skip{k}')
  before = {t: qdraft.agreement(target, plain, windows, t) for t in (0.0, 1.0)}
  if _MINUTES.value > 0:
    draft, hist = qdraft.distill_layer_skip(
        target, k, train_ids, steps=1_000_000, batch=_BATCH.value, seq_len=_SEQ.value,
        learning_rate=_LR.value, max_seconds=_MINUTES.value * 60)
    qdraft.save_distilled(draft, path)
    print(f'distilled {len(hist)} steps in {hist[-1]["seconds"]:.0f} s, KL '
          f'{np.mean([h["kl"] for h in hist[:10]]):.3f} (first 10) -> '
          f'{np.mean([h["kl"] for h in hist[-10:]]):.3f} (last 10); saved {path}', flush=True)
  draft = qdraft.load_distilled(target, path)
  after = {t: qdraft.agreement(target, draft, windows, t) for t in (0.0, 1.0)}
  print(f'\nteacher-forced agreement 1 - E[TV] on {windows.size} held-out positions:')
  print('| draft | T=0 (argmax agrees) | T=1 |\n|---|---|---|')
  print(f'| skip{k} | {before[0.0]:.3f} | {before[1.0]:.3f} |')
  print(f'| skip{k}d | {after[0.0]:.3f} | {after[1.0]:.3f} |', flush=True)

  prompts_BT = speculative_sweep.corpus_prompts(encode, 2, 16)
  rows = []
  for name in _DRAFTS.value.split(','):
    d = speculative_sweep.make_draft(target, name, head_tokens=train_ids,
                                     distilled_dir=_OUT.value)
    for t in [float(x) for x in _TEMPS.value.split(',')]:
      t0 = time.perf_counter()
      r = speculative_sweep.run_point(target, d, prompts_BT, gamma=_GAMMA.value,
                                      temperature=t, max_tokens=_TOKENS.value)
      rows.append(dict(r, draft=name))
      print(f"{name} T={t}: alpha {r['alpha']:.3f} c {r['cost_ratio']:.3f} speedup "
            f"{r['speedup']:.2f} predicted {r['predicted_speedup']:.2f} "
            f"({time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f})", flush=True)
  print(f'\ngamma {_GAMMA.value}, {prompts_BT.shape[0]} prompts x {_TOKENS.value} tokens')
  print('| draft | T | alpha | alpha (1 - TV) | tokens / pass | c | predicted speedup | '
        'plain s | spec s | speedup | greedy agreement |')
  print('|---|---|---|---|---|---|---|---|---|---|---|')
  for r in rows:
    print(f"| {r['draft']} | {r['temperature']} | {r['alpha']:.3f} | {r['alpha_tv']:.3f} | "
          f"{r['tokens_per_pass']:.2f} | {r['cost_ratio']:.3f} | {r['predicted_speedup']:.2f} "
          f"| {r['seconds_plain']:.1f} | {r['seconds_spec']:.1f} | {r['speedup']:.2f} | "
          f"{r.get('greedy_agreement', '')} |")


def main(argv):
  del argv
  target, encode = _load()
  (cost_table if _MODE.value == 'cost' else draft_study)(target, encode)


if __name__ == '__main__':
  app.run(main)
