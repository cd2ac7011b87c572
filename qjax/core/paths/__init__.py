"""The quantized matmul's paths: one table, one chooser, one module per path.

`qeinsum(spec, x, w, path=...)` asks `choose` which implementation runs the call and runs it.
The choice reads the call's facts (`Call`: the weight's code type, groups and layout, the
activation format, the number of rows) and the target (`qjax.target`: the devices the program
is compiled for), and returns the path with its reason (`Choice`), which records and reports
state per layer (`describe`).

| path | fits | 'auto' takes it on |
|---|---|---|
| kernel | symmetric int8 / packed int4, <= 16 rows, the CPU kernel loaded | CPU |
| tiled | (contracted..., kept...) weights, groups on the last contracted axis | CPU |
| vblocks | the tied head (V, D), more than one block of V rows | CPU |
| pallas_tpu | symmetric int8 / native int4 / fp8; scales after each group's sum | TPU |
| pallas_gpu | symmetric int8 / int4 (packed or native), <= 64 rows | NVIDIA: groups, int4 |
| native | codes XLA reads as stored (native layout, 8-bit, fp8) | TPU, GPU |
| int_dot | int8 / fp8 activations (W8A8, fp8 x fp8) as one XLA dot | everywhere |
| dequant | everything: the reference (a float copy of the weight) | last resort |

Each path is a module of this package (`cpu_kernel`, `cpu_tiles`, `cpu_head_blocks`,
`pallas_tpu`, `pallas_gpu`, `native`, `int_dot`, `dequant`) with `fits(call, target, asked)`
(None, or why not) and `run(...)`.

`AUTO` lists, per (platform, weight-only or quantized activations), the order 'auto' tries;
the first whose `fits` says nothing against the call runs. A named path (`path='tiled'`,
`'kernel'`, ...) runs what it names or its documented fallback (`NAMED`), raising where it has
none; a fallback is logged once. tokamax's `implementation=` contract is the model: `None`
('auto') picks, a name runs or says why not.
"""

from qjax.core.paths import (cpu_head_blocks, cpu_kernel, cpu_tiles, dequant, int_dot, native,
                             pallas_gpu, pallas_tpu)
from qjax.core.paths.call import DECODE_ROWS, Call
from qjax.core.paths.choose import (AUTO, IMPLEMENTATIONS, MODULES, NAMED, REQUESTS,
                                    WEIGHT_ONLY_REQUESTS, Choice, candidates, check_request,
                                    choose, family, run)
from qjax.core.paths.describe import describe
from qjax.core.paths.rows import lookup

__all__ = ['AUTO', 'Call', 'Choice', 'DECODE_ROWS', 'IMPLEMENTATIONS', 'MODULES', 'NAMED',
           'REQUESTS', 'WEIGHT_ONLY_REQUESTS', 'candidates', 'check_request', 'choose',
           'cpu_head_blocks', 'cpu_kernel', 'cpu_tiles', 'dequant', 'describe', 'family',
           'int_dot', 'lookup', 'native', 'pallas_gpu', 'pallas_tpu', 'run']
