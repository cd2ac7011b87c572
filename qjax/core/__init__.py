"""Quantization core: formats, the QArray pytree, packing, calibration, qdot, fake_quant."""

__all__ = [
    "QArray", "QFormat", "absmax_range", "choose_path", "compute_range", "dequantize",
    "estimate_nbytes", "fake_quant", "fake_quant_view", "fp8_format", "grouped_view",
    "grouped_view_shape", "int_format", "max_abs_error", "minmax_range", "mse", "mse_range",
    "nbytes", "pack", "packed_length", "percentile_range", "qdot", "qeinsum", "quantize",
    "round_ste", "scale_and_zero_point", "sqnr_db", "unpack",
]

from qjax.core.calibration import (absmax_range, compute_range, grouped_view, grouped_view_shape,
                                   max_abs_error, minmax_range, mse, mse_range, percentile_range,
                                   sqnr_db)
from qjax.core.fake_quant import fake_quant, fake_quant_view, round_ste
from qjax.core.formats import QFormat, fp8_format, int_format
from qjax.core.packing import pack, packed_length, unpack
from qjax.core.qarray import (QArray, dequantize, estimate_nbytes, nbytes, quantize,
                              scale_and_zero_point)
from qjax.core.qdot import choose_path, qdot, qeinsum
from qjax.core.learned import (conversion_range, init_learned, learned_fake_quant,
                               learned_qparams, learned_range, pact_clip, range_for)
