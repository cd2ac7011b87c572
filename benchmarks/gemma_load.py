"""Gemma 3 270M load time from the GGUF: cold (parse + dequantize + write cache) vs warm.

    .venv/bin/python -m benchmarks.gemma_load [--cache_dir=/tmp/qjax_cache_bench]

Expected run time: ~1 min. The cold load uses an empty cache directory (the default one,
~/.cache/qjax, is left alone), then the same loads run again from that cache. Measured on 2
shared cores (load average ~9): cold model 20.9 s (GGUFReader open, dequantize, safetensors
write; 20-50 s over several runs), tokenizer 16.1 s (merges recovered from 262k tokens); warm
model 2.0 s (sha256 of the 253 MB file + 1.07 GB of float32), tokenizer 1.9 s. Peak RSS
2.5 GB cold.
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


def main():
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--cache_dir', default=None, help='empty dir for the run (default: a tmp dir)')
  args = ap.parse_args()
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
