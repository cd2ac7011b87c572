"""Two processes x 4 CPU devices, joined by `jax.distributed.initialize` (gloo collectives,
localhost coordinator): one sharded prefill + decode step agrees with one process.
"""

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np

import sharding_testlib as lib
from qjax import sharding

WORKER = pathlib.Path(__file__).with_name('two_process_worker.py')
TIMEOUT_S = 180


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def test_two_processes_agree_with_one(eight_devices, subprocess_xla_flags, tmp_path):
  env = dict(os.environ, XLA_FLAGS=subprocess_xla_flags)  # 4 devices each: the worker's own
  env['QJAX_WORKER_DEADLINE_S'] = str(TIMEOUT_S - 10)
  port = str(_free_port())
  procs = [subprocess.Popen([sys.executable, str(WORKER), str(pid), port, str(tmp_path)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for pid in (0, 1)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=TIMEOUT_S)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-4000:]
  got = np.load(tmp_path / 'logits.npz')

  model, toks = lib.model(1), lib.tokens()
  sm = sharding.ShardedTransformer(model, sharding.make_mesh('2x2x2'), '2d_ws+mq_batch')
  one_process, cache = lib.sharded(sm, toks, steps=1)
  single_device = lib.reference(model, toks, steps=1)
  for want in (one_process, single_device):
    np.testing.assert_allclose(got['prefill'], want[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got['decode'], want[1], rtol=0, atol=1e-5)
  assert int(got['kv_shard_bytes']) == cache.k[0].addressable_shards[0].data.nbytes
