r"""Where a speculative round's time goes: draft step, target step, target verification pass.

  python -m benchmarks.speculative_bench [--model=tiny|gemma3_270m] [--drafts=int8,skip1]

For each draft and gamma it prints c = draft step / target step and v = verification pass of
gamma + 1 tokens / target step (measured side by side in one process, warm, median of 5),
and the speedup the round would give at the measured alpha: tokens per pass /
(gamma c + v). On an accelerator's memory-bound decode v ~ 1 (Leviathan et al.'s model);
on a compute-bound CPU v approaches gamma + 1, which is what limits speculative decoding
here (docs/readme/speculative.md). Timings taken on a shared machine are only ratios.
"""

from absl import app
from absl import flags
import numpy as np
from flax import nnx

from qjax.infer import SamplingParams, speculative_generate, speculative_sweep
from qjax.nn import Transformer, TransformerConfig

_MODEL = flags.DEFINE_string('model', 'tiny', "'tiny' (random) or 'gemma3_270m'")
_DRAFTS = flags.DEFINE_string('drafts', 'int8,int4_g32,skip1', 'draft names (make_draft)')
_GAMMAS = flags.DEFINE_string('gammas', '1,2,4', 'draft tokens per pass')
_TOKENS = flags.DEFINE_integer('max_tokens', 16, 'tokens generated for alpha')


def main(argv):
  del argv
  if _MODEL.value == 'tiny':
    target = Transformer(TransformerConfig.tiny(max_len=64), rngs=nnx.Rngs(0))
    encode = lambda s: np.frombuffer(s.encode(), np.uint8).astype(np.int32)
  else:
    from qjax.checkpoints import load_gemma3_270m  # pylint: disable=g-import-not-at-top
    target, tok, _ = load_gemma3_270m()
    encode = lambda s: np.asarray(tok.encode(s).ids, np.int32)
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


if __name__ == '__main__':
  app.run(main)
