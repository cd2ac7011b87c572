"""Error messages for names looked up in a registry (chips, models, layouts)."""

from __future__ import annotations

import difflib
from typing import Iterable


def unknown_name(kind: str, name: object, valid: Iterable[str]) -> ValueError:
  """Builds the ValueError for a name that is not in `valid`, suggesting the closest one.

  Args:
    kind: what the name names, e.g. 'chip preset' or 'feed-forward layout'.
    name: the offending value.
    valid: the accepted names.

  Returns:
    A ValueError whose message names the bad value, the closest valid name (if any is
    close) and every valid name.
  """
  valid = sorted(valid)
  close = difflib.get_close_matches(str(name).lower(), valid, n=1, cutoff=0.4)
  hint = f' Did you mean {close[0]!r}?' if close else ''
  return ValueError(f'Unknown {kind} {name!r}.{hint} Valid: {", ".join(valid)}.')


def lookup(kind: str, name: str, table: dict):
  """Returns table[name] (case-insensitive, '-' == '_'), or raises `unknown_name`."""
  key = str(name).lower().replace('-', '_')
  if key not in table:
    raise unknown_name(kind, name, table)
  return table[key]
