"""One process of the two-process test: `python two_process_worker.py PID PORT OUT_DIR`.

Each process owns 4 CPU devices; `jax.distributed.initialize` joins them into one 8-device
2x2x2 mesh over gloo CPU collectives. Both build the same model (same seed), place it under
'2d_ws+mq_batch', prefill a prompt and run one decode step; process 0 saves the logits.
The process stops itself after a deadline, whatever the other one does.
"""

import os
import signal
import sys

PID, PORT, OUT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
signal.alarm(int(os.environ.get('QJAX_WORKER_DEADLINE_S', '150')))  # stop, never hang

import jax  # noqa: E402

jax.config.update('jax_platforms', 'cpu')
jax.config.update('jax_cpu_collectives_implementation', 'gloo')
jax.config.update('jax_num_cpu_devices', 4)
jax.distributed.initialize(coordinator_address=f'localhost:{PORT}', num_processes=2,
                           process_id=PID, initialization_timeout=60)

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sharding_testlib as lib  # noqa: E402  pylint: disable=g-import-not-at-top
from qjax import sharding  # noqa: E402


def main():
  assert jax.process_count() == 2 and jax.device_count() == 8, (jax.process_count(),
                                                                jax.device_count())
  assert jax.local_device_count() == 4
  mesh = sharding.make_mesh('2x2x2')
  model = lib.model(num_kv_heads=1)
  sm = sharding.ShardedTransformer(model, mesh, prefill='2d_ws+mq_batch')
  tokens = lib.tokens()
  cache = sm.init_cache(lib.B, lib.S)
  prefill, cache = sm.prefill(tokens[:, :lib.T], cache)
  decode, cache = sm.decode(tokens[:, lib.T:lib.T + 1], cache)
  everywhere = NamedSharding(mesh, PartitionSpec())
  gather = jax.jit(lambda *a: a, out_shardings=(everywhere, everywhere))
  prefill, decode = gather(prefill, decode)
  if PID == 0:
    np.savez(os.path.join(OUT, 'logits.npz'), prefill=np.asarray(prefill.addressable_data(0)),
             decode=np.asarray(decode.addressable_data(0)),
             kv_shard_bytes=cache.k[0].addressable_shards[0].data.nbytes)
  jax.distributed.shutdown()


if __name__ == '__main__':
  main()
