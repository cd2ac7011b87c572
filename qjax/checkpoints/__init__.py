"""Checkpoints: Orbax save/restore of (quantized) models and conversion records."""

from qjax.checkpoints.records import (RECORD_NAME, REQUIRED_FIELDS, digest, file_sha256,
                                      hardware_info, read_record, runtime_info, tree_sha256,
                                      write_record)
from qjax.checkpoints.orbax_io import restore_state, save_state
from qjax.checkpoints.quantized import (load_quantized, policy_from_dict, policy_to_dict,
                                        save_quantized)

__all__ = ['RECORD_NAME', 'REQUIRED_FIELDS', 'digest', 'file_sha256', 'hardware_info', 'load_quantized', 'policy_from_dict', 'policy_to_dict',
           'read_record', 'restore_state', 'runtime_info', 'save_quantized', 'save_state', 'tree_sha256',
           'write_record']
