"""One run per working directory: an exclusive lock held while a run writes there.

    with workdir_lock(workdir, 'python -m experiments.train ...'):
      ...  # checkpoints, metrics

Two runs on one workdir would interleave their metrics lines and overwrite each other's
checkpoints, each exiting 0. The lock is an advisory `fcntl.flock` on `workdir/.lock`, which
the operating system drops when its holder exits however it ends (a kill leaves no stale
lock); the file names the holder (pid, host, start time, command) for the refusal message.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
from typing import Optional

LOCK_NAME = '.lock'


def _holder(fh) -> str:
  """Who holds the lock, as its file says."""
  fh.seek(0)
  try:
    who = json.loads(fh.read() or '{}')
  except ValueError:
    who = {}
  if not who:
    return 'another process (it has not written its name yet)'
  return (f"pid {who.get('pid')} on {who.get('host')} since {who.get('started')} "
          f"({who.get('command')})")


@contextlib.contextmanager
def workdir_lock(workdir: str, command: Optional[str] = None):
  """Hold `workdir`'s lock for the block.

  Args:
    workdir: the run's directory (created when absent).
    command: what runs, for a second run's message (default: this process's argv).

  Raises:
    RuntimeError: another process holds it, naming that process and the fix.
  """
  import fcntl  # pylint: disable=g-import-not-at-top  (POSIX only)
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, LOCK_NAME)
  with open(path, 'a+', encoding='utf-8') as fh:
    try:
      fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise RuntimeError(f'workdir {workdir!r} is in use by {_holder(fh)}: two runs would '
                         'interleave their metrics and overwrite each other\'s checkpoints. '
                         'Wait for it to finish (a rerun then resumes), or pass another '
                         'workdir.') from None
    try:
      fh.seek(0)
      fh.truncate()
      fh.write(json.dumps({
          'pid': os.getpid(), 'host': socket.gethostname(),
          'started': datetime.datetime.now(datetime.timezone.utc).isoformat(
              timespec='seconds'),
          'command': command or ' '.join(sys.argv)}))
      fh.flush()
      yield
    finally:
      fh.seek(0)
      fh.truncate()
      fcntl.flock(fh, fcntl.LOCK_UN)
