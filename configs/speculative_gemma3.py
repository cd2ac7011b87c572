r"""Speculative decoding on Gemma 3 270M: draft precision x gamma x temperature.

Points: drafts {float (the target drafting for itself, alpha = 1), int8, int4 g128 RTN / GPTQ
/ AWQ, int3 g128, int4 g128 + int4 KV cache, the first 6 of 18 layers, the same distilled
(skip6d), int4 g128 / skip6d with an 8192-token head (+head8192), and the W8A8 / W4A8 drafts (_a8:
every weight, the tied head included, with dynamic int8 activations: the fast decode kernels
of qjax.kernels)} x gamma {1, 2, 4, 8}
x temperature {0, 0.7, 1.0}; each decodes 2 prompts per corpus (Tiny Shakespeare, WikiText-2)
plainly and speculatively. skip6d is read from <distilled_dir>/skip6_distilled.npz, written
by `python -m benchmarks.speculative_bench --mode=drafts --model=gemma3_270m --skip=6`
(the point is recorded as failed until it exists); a '+head<K>' head scores the K most
frequent tokens of the draft-training text (`speculative_sweep.train_text`). Rows
(<out_dir>/results.jsonl, table.md): alpha measured and from 1 - TV(p, q), tokens per target
pass vs (1 - alpha^(g+1)) / (1 - alpha), target passes per token, wall-clock speedup over
plain decoding of the same target, greedy agreement with plain greedy (1.0 = exact) or the
shift of the mean target log-probability per token (0 in expectation when exact), and the KL
columns (`qjax.pipeline.speculative_sweep` docstring): kl_exact (KL of the law verify emits
vs the target's, ~1e-7 = float rounding) and, with kl_rows > 0, the first token's empirical
KL over kl_rows seeded rows against its null spread (kl_z). plot.png: alpha vs draft bits,
speedup vs gamma. Rerunning skips finished points; a failing point is recorded and the sweep
goes on (`qjax.pipeline.speculative_sweep`).

Command:
  .venv/bin/python -m experiments.speculative --config=configs/speculative_gemma3.py
  --config.small=True: one greedy and one sampled point (int4 g128, gamma 4), 8 tokens.
  --config.model=tiny: the same on a random tiny model (seconds; what the test runs).
  --config.idle=True: the whole grid cut to fit ~12 minutes on 2 idle cores (`idle`).
Expected run time: full sweep, hours on 2 busy CPU cores (96 points, each compiling a draft
  round and a plain decode step for Gemma); small: ~5-10 minutes (the GGUF load included).
Expected metric: greedy agreement 1.0 on every greedy point (speculative greedy is plain
  greedy); |alpha - alpha_tv| within sampling noise; tokens / pass close to the formula.
  Speedups on this CPU are bounded by the draft's cost relative to the target's (a weight-
  quantized draft dequantizes on the fly, so on CPU it is not much cheaper per token than
  the float target; the layer-skip draft is ~1/3 of it). The measured sweep:
  docs/speculative.md (best 1.43x, the int8 draft at gamma 2, greedy).
"""

import ml_collections

DRAFTS = ('float', 'int8', 'int4_g128', 'int4_g128_gptq', 'int4_g128_awq', 'int3_g128',
          'int4_g128+kv_int4', 'skip6', 'skip6d', 'int4_g128+head8192', 'skip6d+head8192',
          'int8_a8', 'int4_g128_a8')


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = 'gemma3_270m'          # or 'tiny': a random tiny model (tests, smoke runs)
  c.small = False                  # one greedy and one sampled point, few tokens
  c.idle = False                   # the grid cut to ~12 minutes (`idle`)
  c.drafts = ','.join(DRAFTS)
  c.gammas = '1,2,4,8'
  c.temperatures = '0,0.7,1.0'
  c.prompts_per_corpus = 2
  c.prompt_len = 32
  c.max_tokens = 32
  c.calib_windows = 4              # per corpus, for the GPTQ / AWQ drafts
  c.calib_len = 128
  c.seed = 0
  c.kl_rows = 32                   # rows of the first prompt for the first-token KL; 0: off
  c.distilled_dir = 'results/speculative_drafts'   # where skip<k>d drafts are read
  c.time_budget_s = 0.0            # > 0: stop starting points after this; a rerun resumes
  c.out_dir = 'results/speculative_gemma3'
  return c


def small(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The quick mode (`--config.small=True`): 2 points, 8 tokens, 1 prompt per corpus."""
  c = ml_collections.ConfigDict(c.to_dict())
  c.drafts, c.gammas, c.temperatures = 'int4_g128', '4', '0,1.0'
  c.prompts_per_corpus, c.prompt_len, c.max_tokens = 1, 16, 8
  return c


def idle(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The idle-machine mode (`--config.idle=True`): every draft x gamma x temperature of the
  grid, on 1 prompt per corpus of 16 tokens, 8 new tokens, no first-token KL rows (each
  would compile one more round per draft and gamma), GPTQ / AWQ calibrated on 2 windows per
  corpus, written to its own out_dir. One draft x gamma compiles its own round (~30-60 s
  for Gemma), so the 156 points do not fit 12 minutes: after 600 s the run stops starting
  points and says how many are left; rerunning the same command resumes (2-4 runs)."""
  c = ml_collections.ConfigDict(c.to_dict())
  c.prompts_per_corpus, c.prompt_len, c.max_tokens = 1, 16, 8
  c.kl_rows, c.calib_windows = 0, 2
  c.time_budget_s = c.time_budget_s or 600.0  # then the rest is left for a rerun (resumes)
  if c.out_dir == get_config().out_dir:  # an --config.out_dir given on the command line wins
    c.out_dir = 'results/speculative_gemma3_idle'
  return c
