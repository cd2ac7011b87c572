"""Gemma 3 270M load time from the GGUF: cold (parse + dequantize + write cache) vs warm.

    .venv/bin/python -m benchmarks.gemma_load [--cache_dir=/tmp/qjax_cache_bench]

Loading a saved quantized checkpoint (peak RSS next to the weight bytes; run each step in
its own process, the load under `/usr/bin/time -v` for the peak RSS):

    .venv/bin/python -m benchmarks.gemma_load --save_quantized=/tmp/gemma_int4   # int4 g128
    /usr/bin/time -v .venv/bin/python -m benchmarks.gemma_load --load_quantized=/tmp/gemma_int4

The save quantizes while loading (`load_gemma3_270m(policy=)`, every weight incl. the tied
embedding/head int4 g128 RTN) and writes `save_quantized`'s directory; the load is
`load_quantized` (restore onto an abstract skeleton, then the hash and fingerprint checks).

Expected run time: ~1 min. The cold load uses an empty cache directory (the default one,
~/.cache/qjax, is left alone), then the same loads run again from that cache. On 2 cores a
cold model load (GGUFReader open, dequantize, safetensors write) and the cold tokenizer (merges
recovered from 262k tokens) take tens of seconds each, the warm loads a few seconds (the sha256
of the 253 MB file and 1.07 GB of float32). The reload's measured memory:
docs/fast_decode.md#measured-reloading-a-saved-int4-model.
"""

import argparse
import os
import resource
import shutil
import tempfile
import time

from qjax.checkpoints.gemma3 import gemma3_270m_path
from qjax.checkpoints.gguf import load_gguf
from qjax.checkpoints.tokenizer import gguf_tokenizer


def _int4_policy():
  from qjax import int_format  # pylint: disable=g-import-not-at-top
  from qjax.nn import QuantPolicy, QuantRule  # pylint: disable=g-import-not-at-top
  return QuantPolicy((QuantRule('.*', int_format(4, group_size=128)),))


def _rss_mib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def save_int4(out_dir: str) -> None:
  """Quantize Gemma while loading and save it with a conversion record."""
  from qjax.checkpoints import REQUIRED_FIELDS, load_gemma3_270m, save_quantized  # pylint: disable=g-import-not-at-top
  t = time.perf_counter()
  model, _, info = load_gemma3_270m(policy=_int4_policy())
  record = {f: 'none' for f in REQUIRED_FIELDS if f not in ('runtime', 'hardware', 'artifacts')}
  record.update(base_checkpoint=f"gemma3-270m gguf sha256 {info['sha256']}",
                weight_formats='int4 g128 RTN, every weight incl. the tied embedding/head')
  save_quantized(out_dir, model, _int4_policy(), record)
  print(f'saved {out_dir} in {time.perf_counter() - t:.1f} s, peak RSS {_rss_mib():.0f} MiB',
        flush=True)


def load_saved(out_dir: str) -> None:
  """`load_quantized(out_dir)`: seconds, peak RSS and the weight bytes it holds."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from qjax.checkpoints import load_quantized  # pylint: disable=g-import-not-at-top
  rss0 = _rss_mib()
  t = time.perf_counter()
  model, _ = load_quantized(out_dir)
  seconds = time.perf_counter() - t
  weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
  print(f'load_quantized: {seconds:.1f} s, weights {weights / 2**20:.0f} MiB, peak RSS '
        f'{_rss_mib():.0f} MiB ({rss0:.0f} MiB after imports)', flush=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--cache_dir', default=None, help='empty dir for the run (default: a tmp dir)')
  ap.add_argument('--save_quantized', default=None, help='save int4 g128 Gemma to this dir')
  ap.add_argument('--load_quantized', default=None, help='load a saved quantized Gemma')
  args = ap.parse_args()
  if args.save_quantized or args.load_quantized:
    if args.save_quantized:
      save_int4(args.save_quantized)
    else:
      load_saved(args.load_quantized)
    return
  print(f'load average: {os.getloadavg()}', flush=True)
  cache_dir = args.cache_dir or tempfile.mkdtemp(prefix='qjax_cache_bench_')
  path = gemma3_270m_path()
  try:
    for attempt in ('cold', 'warm'):
      _, info = load_gguf(path, cache_dir=cache_dir)
      t = time.perf_counter()
      gguf_tokenizer(path, cache_dir=cache_dir)
      tok_s = time.perf_counter() - t
      rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
      print(f"{attempt}: model {info['seconds']:.1f} s (cache {info['cache']}), tokenizer "
            f'{tok_s:.1f} s, peak RSS {rss_gb:.2f} GB', flush=True)
  finally:
    if args.cache_dir is None:
      shutil.rmtree(cache_dir, ignore_errors=True)


if __name__ == '__main__':
  main()
