r"""Plan Gemma 3 270M inference on one H200 (bf16), the model qjax quantizes.

Command:
  python -m experiments.plan --config=configs/plan_gemma3_h200.py
  (--config.decode.weight_bits=4 for a 4-bit model, --config.n_chips=8 for a whole HGX
  board, where layouts start to differ)

Expected run time: ~3 s on 2 CPU cores.

Expected output: on one chip every layout shards nothing, so each table collapses to one
row. Prefill of 1 x 1024 tokens: ~0.6 ms, compute bound (MFU ~0.93). Decode at batch 64,
256 tokens after a 1024-token prompt: ~0.39 ms per step (~0.10 s in all), memory bound,
reading ~0.28 ms of KV cache (1.5 GB at the end) against 0.11 ms of weights (0.54 GB);
~2 GB per chip of 141 GB. latency_vs_batch.png and table.txt land in
results/plan/gemma3_h200/.
"""

import ml_collections


def shared(**fields) -> ml_collections.ConfigDict:
  """The planning fields every plan config shares (layouts, rules, efficiency), + `fields`."""
  c = ml_collections.ConfigDict()
  c.mesh = ''
  c.layouts = 'all'
  c.pad_heads = True
  c.pad_kv_heads = False
  c.interconnect = 'all_links'
  c.combine = 'serial'
  c.efficiency = ml_collections.ConfigDict(dict(
      flops=1.0, hbm=1.0, ici=1.0, collective_latency_s=0.0, step_overhead_s=0.0))
  c.compare_paper = False
  c.slice = ''  # a TPU slice ('v5e:2x4', 'v4:4x4x4'): also compile every layout for it
  c.compile_depths = (1, 2)  # layers compiled and extrapolated from; () compiles them all
  c.out_dir = ''
  c.update(fields)
  return c


def get_config() -> ml_collections.ConfigDict:
  """The Gemma 3 270M / 1 x H200 planning run."""
  return shared(
      name='gemma3_h200', model='gemma3_270m', chip='h200', n_chips=1,
      prefill=ml_collections.ConfigDict(dict(
          batch=1, prompt_len=1024, history_len=0, weight_bits=16, act_bits=16, kv_bits=16)),
      decode=ml_collections.ConfigDict(dict(
          batch=64, prompt_len=1024, gen_len=256, history_len=0, weight_bits=16, act_bits=16,
          kv_bits=16)),
      plot_batches=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
