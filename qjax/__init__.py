"""qjax: quantized and efficient transformer inference and training in JAX/Flax.

The public API is re-exported here; implementations live in the subpackages
(`core`, `nn`, `train`, `eval`, `checkpoints`, `costmodel`, ...).
"""

from qjax.core import *  # noqa: F401,F403  (the quantization core is the top-level API)
from qjax.core import __all__ as _core_all  # type: ignore
from qjax import target  # noqa: F401  (the devices programs are traced for)

__version__ = '0.1.0'
