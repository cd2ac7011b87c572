"""The suite's backend marker, apart from conftest.py so a test can import it by a name no
other module in tests/ has (`@pytest.mark.backend`, registered in tests/conftest.py)."""

BACKENDS = ('cpu', 'gpu', 'tpu')


def backend_skip_reason(names, reason: str, backend: str):
  """Why a test marked `backend(*names, reason=...)` does not run on `backend` (None: it runs)."""
  unknown = [n for n in names if n not in BACKENDS]
  if not names or unknown:
    raise ValueError(f'@pytest.mark.backend{tuple(names)}: name one or more of {BACKENDS}.')
  if backend in names:
    return None
  return (f"{' / '.join(names)} only ({reason or 'a backend-specific property'}); the default "
          f'backend is {backend}')
