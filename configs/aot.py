r"""Compile a model's prefill and decode steps for TPUs and a GPU this machine does not have,
and read the compiler's prediction for each (experiments/aot.py; docs/aot.md).

Command (the toolchain first, once: python -m qjax.aot.install):
  JAX_PLATFORMS=cpu python -m experiments.aot --config=configs/aot.py
  ... --config.model=llama32_1b   (or llama3_8b, tiny, a HF config.json, a .gguf file)
  ... --config.targets=v5e-1,h200 --config.formats=bf16,int4 --config.batches=1,8,64
  JAX_PLATFORMS=cpu python -m experiments.aot --config=configs/aot.py:small   (a tiny model)

Expected run time on 2 CPU cores: `:small` ~25 s of CPU (16 compiles of a 2-layer model).

Expected result (the compiler's prediction; nothing runs): `:small` compiles every program for
both targets, int4 holds under half of bf16's weight bytes, and the TPU's prefill carries the
splash kernel (kernels: mosaic).
"""

import ml_collections


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  """The Gemma 3 270M check on v5e-1, v6e-1 and H200; `:small` is a tiny model, two formats."""
  c = ml_collections.ConfigDict()
  c.model = 'gemma3_270m'     # a preset (tiny, gemma3_270m, llama32_1b, llama3_8b), a HF
                              # config.json (or its folder) or a .gguf file (metadata only)
  c.formats = 'bf16,int8,int4,int4_g128,fp8,w8a8'   # qjax.aot.programs.FORMATS
  c.targets = 'v5e-1,v6e-1,h200'                    # qjax.aot.TARGETS
  c.batches = '1,8'           # the decode step at each batch
  c.context = 128             # tokens in the KV cache before a decode step
  c.prefill_len = 512         # prompt tokens of the prefill program (0: no prefill)
  c.loop_steps = 0            # > 0: also the decode_steps loop of this many steps at batches[0]
  c.layers = 0                # 0: full depth; k: compile k and 2k layers, extrapolate
  c.out_dir = ''              # '': results/aot in the checkout; <out_dir>/<model>-<target>/
  if arg == 'small':
    c.update(model='tiny', formats='bf16,int4', targets='v5e-1,h200', batches='1,2',
             context=16, prefill_len=16)
  elif arg:
    raise ValueError(f"configs/aot.py: argument {arg!r} is unknown; use '' or 'small'.")
  return c
