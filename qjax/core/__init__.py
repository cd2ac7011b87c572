"""Quantization core: formats, the QArray pytree, its numerics, packing, storage layouts,
calibration, qdot, fake quantization and learned (LSQ / PACT) quantization parameters."""

__all__ = [
    "LAYOUT_VERSION", "QArray", "QFormat", "QType", "absmax_range", "broadcast_scale",
    "check_finite", "choose_path", "compute_range", "conversion_range", "dequantize",
    "estimate_nbytes", "fake_quant", "fake_quant_view", "fake_round", "first_of_tiles",
    "fp8_format",
    "from_codes", "init_learned", "int_format", "learned_fake_quant", "learned_qparams",
    "learned_range", "max_abs_error", "minmax_range", "mse", "mse_range", "nbytes", "pact_clip",
    "pack", "packed_length", "percentile_range", "qdot", "qeinsum", "quantize", "range_for",
    "round_ste", "scale_and_zero_point", "scale_shape", "sqnr_db", "tile_shape", "tiled",
    "unpack",
    "default_layout", "relayout", "to_layout",  # qjax.core.layouts
    "float_einsum",  # qjax.core.decode_paths
]

from qjax.core.calibration import (absmax_range, compute_range, max_abs_error, minmax_range, mse,
                                   mse_range, percentile_range, sqnr_db)
from qjax.core.decode_paths import float_einsum
from qjax.core.fake_quant import fake_quant, fake_quant_view, round_ste
from qjax.core.formats import QFormat, fp8_format, int_format
from qjax.core.layouts import default_layout, relayout, to_layout
from qjax.core.learned import (conversion_range, init_learned, learned_fake_quant,
                               learned_qparams, learned_range, pact_clip, range_for)
from qjax.core.numerics import (broadcast_scale, check_finite, fake_round, first_of_tiles,
                                scale_and_zero_point, scale_shape, tile_shape, tiled)
from qjax.core.packing import pack, packed_length, unpack
from qjax.core.qarray import (LAYOUT_VERSION, QArray, QType, dequantize, estimate_nbytes,
                              from_codes, nbytes, quantize)
from qjax.core.qdot import choose_path, qdot, qeinsum
