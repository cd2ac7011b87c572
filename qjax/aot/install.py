"""`python -m qjax.aot.install [folder]`: install the compile-only toolchains (libtpu, the
CUDA plugin) for this jax and Python into their own folder (`qjax.aot.toolchain`), then print
the versions installed."""

import json
import pathlib
import sys

from qjax.aot import toolchain


def main() -> None:
  folder = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else None
  manifest = toolchain.install(folder)
  print(json.dumps({'folder': str(folder or toolchain.default_dir()), **manifest}, indent=1))


if __name__ == '__main__':
  main()
