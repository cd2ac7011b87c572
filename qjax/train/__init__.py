"""Training: data, optimizers, quantization-aware training and distillation.

    from qjax.train import data, optim
    from qjax.train import prepare_qat, make_qat_optimizer, qat_step, convert
    from qjax.train import distill_loss, distill_step, chunked_distill_loss, lean_step
    from qjax.train import AdapterPolicy, AdapterRule, apply_adapters, lora_step  # LoRA
    from qjax.train import lora_io  # adapters saved alone, loaded onto a base with its hash
"""

from qjax.train import data, optim
from qjax.train.distill import (check_distill, check_teacher, chunked_distill_loss, distill_loss,
                                distill_step, student_config)
from qjax.train.lean_step import lean_step
from qjax.train.optim import make_optimizer
from qjax.train.qat import (TRAINABLE, QATScale, activation_format, lm_loss, make_qat_optimizer,
                            prepare_qat, qat_step, relative_adam)
from qjax.train.qat_convert import convert, float_model, learned_ranges, learned_scales
from qjax.train import lora, lora_core, lora_io
from qjax.train.lora import (AdapterPolicy, AdapterRule, LoRAEinsum, apply_adapters,
                             make_lora_optimizer, merge_adapters, remove_adapters, lora_step,
                             trainable_params)
from qjax.core import range_for  # the core's, re-exported here where QAT users find it

__all__ = [
    'QATScale', 'TRAINABLE', 'activation_format', 'check_distill', 'check_teacher',
    'chunked_distill_loss', 'convert', 'data', 'distill_loss', 'distill_step', 'float_model',
    'lean_step', 'learned_ranges', 'learned_scales', 'lm_loss', 'make_optimizer',
    'make_qat_optimizer', 'optim', 'prepare_qat', 'qat_step', 'range_for', 'relative_adam',
    'student_config',
    # LoRA / QLoRA
    'AdapterPolicy', 'AdapterRule', 'LoRAEinsum', 'apply_adapters', 'lora', 'lora_core',
    'lora_io', 'lora_step', 'make_lora_optimizer', 'merge_adapters', 'remove_adapters',
    'trainable_params',
]
