"""Experiment pipelines: what the `experiments/` entry points, tests and benchmarks share.

It sits above `train`, `eval`, `algorithms` and `checkpoints` (nothing in qjax imports it):

    from qjax import pipeline
    final = pipeline.train(config, workdir)                   # training run, resumable
    model, config, data = pipeline.load_trained(workdir)
    ref = pipeline.FloatReference(model, data, config.eval)  # the float model, evaluated once
    row = pipeline.quantize_and_evaluate(ref, config.quant, out_dir, base_hash)  # one PTQ point
    rows = pipeline.run_ptq_sweep(config, points)             # a config's sweep()
    rows = pipeline.run_qat_sweep(config, points)             # RTN vs QAT vs QAT + distillation

    rows = pipeline.finetune.run_finetune_sweep(config, points, ctx)  # QLoRA vs full FT
    rows = pipeline.finetune_qat.run_qat_gemma_sweep(config, points, ctx)  # QAT + distill

Gemma 3 270M's evaluation data and per-source-type metrics are in `qjax.pipeline.gemma`.
"""

from qjax.pipeline import finetune, finetune_qat
from qjax.pipeline.manifest import (provenance, provenance_changes, read_manifest,
                                    verify_checkpoint)
from qjax.pipeline.ptq import (FloatReference, base_checkpoint_hash, calibration_set,
                               check_exempt, evaluate, format_label, make_policy, point_name,
                               quantize, quantize_and_evaluate, resolved_path, save_and_verify)
from qjax.pipeline.qat import (QAT_COLUMNS, QAT_METHODS, kv_name, load_teacher, qat_point,
                               qat_point_name, recovered, run_qat_sweep, train_loop)
from qjax.pipeline.sweeps import apply_overrides, load_sweep, run_ptq_sweep, sweep_point_name
from qjax.pipeline.training import (build, check_train_config, load_trained, model_config, train,
                                    train_step, trained_checkpoint)

__all__ = [
    'FloatReference', 'QAT_COLUMNS', 'QAT_METHODS', 'apply_overrides', 'base_checkpoint_hash',
    'build', 'calibration_set', 'check_exempt', 'check_train_config', 'evaluate',
    'provenance', 'provenance_changes', 'read_manifest', 'trained_checkpoint',
    'verify_checkpoint', 'format_label', 'kv_name', 'load_sweep',
    'load_teacher', 'load_trained', 'make_policy', 'model_config', 'point_name', 'qat_point',
    'qat_point_name', 'quantize', 'quantize_and_evaluate', 'recovered', 'resolved_path',
    'run_ptq_sweep', 'run_qat_sweep', 'save_and_verify', 'sweep_point_name', 'train',
    'train_loop', 'train_step', 'finetune', 'finetune_qat',
]
