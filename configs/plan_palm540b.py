r"""Plan PaLM 540B inference on 64 TPU v4 chips: Pope et al. 2022's low-latency setting.

Command:
  python -m experiments.plan --config=configs/plan_palm540b.py
  (e.g. --config.decode.batch=512 --config.decode.weight_bits=16 for the high-throughput
  decode row, --config.interconnect=per_axis for the per-axis interconnect model)

Expected run time: ~5 s on 2 CPU cores (roofline sums; the plot sweep dominates).

Expected output: two tables (prefill B=1, int8; decode B=64, int8, 64 tokens after a
2048-token prompt), one row per layout at its best mesh. The winners are the paper's:
  prefill  2d_ws+mq_heads (heads padded 48 -> 64)  ~0.17 s, MFU ~0.74, compute bound
  decode   2d_ws+mq_batch on 4x4x4                 ~8.4 ms/token, MFU ~0.47, memory bound
then Table 2 of the paper next to the roofline (measured / roofline = 1.7, 3.4, 1.2, 2.3,
every measured time above its roofline), and latency_vs_batch.png plus table.txt in
results/plan/palm540b/.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """The PaLM 540B / 64 x TPU v4 planning run."""
  c = ml_collections.ConfigDict()
  c.name = 'palm540b'
  c.model = 'palm_540b'
  c.chip = 'tpu_v4'
  c.n_chips = 64
  c.mesh = ''  # '' searches every x*y*z factorization; '4x4x4' pins one.
  c.layouts = 'all'  # or a comma-separated list such as '2d_ws+mq_batch,wg_xyz+mq_heads'
  c.pad_heads = True  # Pope et al. padded 48 -> 64 heads to shard them over 64 chips.
  c.interconnect = 'all_links'  # the paper's model; 'per_axis' for links per torus axis
  c.combine = 'serial'  # max(compute, memory) + comm; 'overlap' for max of all three

  c.prefill = ml_collections.ConfigDict(dict(
      batch=1, prompt_len=2048, history_len=0, weight_bits=8, act_bits=16, kv_bits=16))
  c.decode = ml_collections.ConfigDict(dict(
      batch=64, prompt_len=2048, gen_len=64, history_len=0, weight_bits=8, act_bits=16,
      kv_bits=16))
  # The pure roofline (a lower bound). Lower these only from measurements of your stack.
  c.efficiency = ml_collections.ConfigDict(dict(
      flops=1.0, hbm=1.0, ici=1.0, collective_latency_s=0.0, step_overhead_s=0.0))

  c.plot_batches = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
  c.compare_paper = True
  c.slice = ''  # 'v4:4x4x4': also compile every layout for that slice (see the docstring)
  c.compile_depths = (1, 2)  # layers compiled and extrapolated from; () compiles them all
  c.out_dir = ''  # default results/plan/<name>/
  return c
