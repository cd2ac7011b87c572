"""Post-training quantization algorithms: the pure array math (`<name>_core.py`).

Each takes streamed calibration statistics, never a model: GPTQ and AWQ the input Hessian
2 X^T X / n (`hessian_update`), AWQ also mean |x| (`absmean_update`), SmoothQuant max |x|
(`absmax_update`); LLM.int8() needs none. Weights are `w_DF` (y = x @ w).
"""

__all__ = [
    "apply_method", "fold_scales",
    "AWQResult", "absmax_update", "absmean_update", "awq_scales", "awq_search",
    "gptq_quantize", "hessian_update", "llm_int8_matmul", "outlier_counts", "outlier_features",
    "output_error",
    "smooth", "smooth_scales", "smoothquant_weight", "w8a8_matmul",
]

from qjax.algorithms.awq_core import (AWQResult, absmean_update, awq_scales, awq_search,
                                      output_error)
from qjax.algorithms.gptq_core import gptq_quantize, hessian_update
from qjax.algorithms.llm_int8_core import llm_int8_matmul, outlier_counts, outlier_features
from qjax.algorithms.smoothquant_core import (absmax_update, smooth, smooth_scales,
                                              smoothquant_weight, w8a8_matmul)

# Integration: walk a model, calibrate layer by layer, write results through the policy.
from qjax.algorithms.apply import apply_method  # noqa: E402
from qjax.algorithms.stages import fold_scales  # noqa: E402
