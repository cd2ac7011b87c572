r"""Plan a custom model on a custom chip: every input given in the config, no preset.

Command:
  python -m experiments.plan --config=configs/plan_custom.py
  (--config.combine=additive for compute + memory + comm without overlap; 'serial' and
  'overlap' are the other rules; --config.pad_kv_heads=True pads kv heads to the shard count
  for 'multihead' attention)

The model is a Llama-3-8B-like shape (32 layers, d_model 4096, d_ff 14336 SwiGLU, 32 query
heads of 128, 8 kv heads, vocab 128,256, untied); the chip a made-up accelerator with 48 GB of
HBM at 2 TB/s, 400 TFLOP/s bf16 / 800 TOP/s int8 and 300 GB/s of interconnect, 8 chips.
To give the model by totals instead, replace c.model with
  ml_collections.ConfigDict(dict(name='llama3_8b_totals', n_params=8_030_261_248,
      kv_bytes_per_token=131_072, n_layers=32, d_model=4096, vocab=128_256))

Expected run time: ~3 s on 2 CPU cores.
Expected output: the per-layout tables; 'multihead' attention with 8 kv heads on an 8-chip
1D axis fits without padding; decode at batch 32 is memory bound; table.txt and
latency_vs_batch.png in results/plan/custom/. The last line states the model, chip, combining
rule and kv-head padding used.
"""

import ml_collections

from configs.plan_gemma3_h200 import shared


def get_config() -> ml_collections.ConfigDict:
  return shared(
      name='custom',
      model=ml_collections.ConfigDict(dict(
          name='llama3_8b_like', n_layers=32, d_model=4096, d_ff=14336, n_heads=32,
          head_dim=128, n_kv_heads=8, vocab=128_256, glu=True, tied_embeddings=False,
          parallel_block=False)),
      chip=ml_collections.ConfigDict(dict(
          name='accel_48g', bf16_flops=400e12, int8_flops=800e12, fp8_flops=800e12,
          hbm_bytes=48e9, hbm_bw=2.0e12, ici_bw=300e9, ici_links=4, topology='switch',
          domain_size=8, scaleout_bw=25e9)),
      n_chips=8,
      prefill=ml_collections.ConfigDict(dict(
          batch=1, prompt_len=2048, history_len=0, weight_bits=16, act_bits=16, kv_bits=16)),
      decode=ml_collections.ConfigDict(dict(
          batch=32, prompt_len=2048, gen_len=128, history_len=0, weight_bits=8, act_bits=16,
          kv_bits=16)),
      plot_batches=(1, 4, 16, 64, 256))
