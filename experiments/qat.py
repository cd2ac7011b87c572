r"""Quantization-aware training and distillation of a trained run, and the QAT sweep.

  python -m experiments.qat --config=configs/qat_sweep.py --config.workdir=/tmp/qat_base \
      --config.out_dir=/tmp/qat_sweep [--config.qat.steps=200]

Runs the config's `sweep()` (points override e.g. quant.bits, quant.group_size and
quant.method in {'rtn', 'qat', 'qat+distill'}) through `qjax.pipeline.run_qat_sweep`. An
'rtn' point is the PTQ sweep's point (`python -m experiments.quantize`); a QAT point starts
from it (same policy, scales initialised from the same calibration), trains with
fake-quantized weights (LSQ scales with their own learning rate; with '+distill', against
the float model restored from the checkpoint as a frozen teacher), converts with
`qjax.train.convert` and is evaluated, saved and reloaded exactly like a PTQ point. Results
append to <out_dir>/results.jsonl (resumable), with table.md, ppl_vs_bytes.png and
summary.json (the fraction of RTN's perplexity loss each QAT point recovers, and its
training cost).

With --config.qat.kv=int4 (or int8, fp8, fp8_e5m2) QAT points also train with keys and
values fake-quantized as that KV cache stores them; the converted model keeps the format, so
its perplexity (a full forward) is the perplexity under that cache, greedy generation runs
through that cache, the record's kv_cache_format names it, and the row adds
float_cache_ppl (the same model with a float cache). RTN points are served with the same
cache (`quant.kv`), so `recovered` compares like with like; all are named '...-kv<fmt>'.
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from qjax import eval as qeval
from qjax import pipeline

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/qat_sweep.py', lock_config=True)


def main(argv):
  del argv
  config = _CONFIG.value
  path = config_flags.get_config_filename(flags.FLAGS['config'])
  rows = pipeline.run_qat_sweep(config, pipeline.load_sweep(path)())
  print(qeval.markdown_table(rows, pipeline.QAT_COLUMNS))
  qeval.require_success(rows)  # every point failed: exit non-zero


if __name__ == '__main__':
  app.run(main)
