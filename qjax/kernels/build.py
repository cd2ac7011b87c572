"""Build (or find) the CPU kernel for this machine in the per-user cache, ahead of first use.

    python -m qjax.kernels.build          # what `make install` runs; never fails

Prints where the library is and whether it was cached, built or rebuilt, or why there is
none (then qjax runs its XLA paths). `qjax.kernels._build` says where the cache is and what
its key holds.
"""

import sys

from qjax import kernels
from qjax.kernels import _build


def main() -> int:
  library, how = _build.ensure(kernels.cpu_flags(), retry_failed=True, say=print)
  if library is None:
    print(f'qjax.kernels: not built ({how}); qjax uses its XLA paths.')
  else:
    print(f'qjax.kernels: {library} ({how})')
  return 0


if __name__ == '__main__':
  sys.exit(main())
