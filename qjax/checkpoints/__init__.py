"""Checkpoints: HF / GGUF import, Orbax save/restore of (quantized) models, conversion records.

    model, info = load_hf('hf_dir')                  # Llama 3.x, Mistral, Qwen 2/3, Gemma 2/3
    tokenizer = HFTokenizer.from_dir('hf_dir')      # tokenizer.json + its chat template
"""

from qjax.checkpoints.records import (FIELD_TYPES, RECORD_NAME, REQUIRED_FIELDS,
                                      check_tree_hashes, content_sha256, conversion_record, digest,
                                      file_sha256,
                                      hardware_info, read_record, record_sha256, runtime_info,
                                      tree_sha256, validate_record, write_record)
from qjax.checkpoints.orbax_io import restore_state, save_state
from qjax.checkpoints.quantized import (check_fingerprint, fingerprint_tokens, load_quantized,
                                        logits_fingerprint, policy_from_dict, policy_to_dict,
                                        save_quantized, skeleton, structure_fields)

from qjax.checkpoints.gemma3 import gemma3_270m_path, load_gemma3_270m
from qjax.checkpoints.gguf import GEMMA3_FACTS, gguf_config, load_gguf, open_gguf
from qjax.checkpoints.params import model_from_params, model_params, param_shapes
from qjax.checkpoints.hf_tokenizer import HFTokenizer
from qjax.checkpoints.safetensors_io import hf_config, load_hf
from qjax.checkpoints.tokenizer import build_tokenizer, check_vocab, gguf_tokenizer

__all__ = [
    'FIELD_TYPES', 'GEMMA3_FACTS', 'RECORD_NAME', 'REQUIRED_FIELDS', 'build_tokenizer',
    'check_fingerprint', 'check_tree_hashes', 'check_vocab', 'content_sha256',
    'fingerprint_tokens',
    'logits_fingerprint', 'record_sha256', 'validate_record',
    'digest', 'file_sha256', 'gemma3_270m_path', 'gguf_config', 'gguf_tokenizer',
    'hardware_info', 'hf_config', 'load_gemma3_270m', 'load_gguf', 'load_quantized',
    'HFTokenizer', 'load_hf', 'model_from_params', 'model_params',
    'open_gguf', 'param_shapes',
    'policy_from_dict', 'policy_to_dict', 'read_record', 'restore_state', 'runtime_info',
    'save_quantized', 'save_state', 'skeleton', 'structure_fields', 'tree_sha256',
    'conversion_record', 'write_record',
]
