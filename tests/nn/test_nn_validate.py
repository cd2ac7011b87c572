"""qjax.nn.validate on its own: what each check accepts, returns and refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qjax.nn import validate


def test_token_ids_returns_host_int32_and_keeps_device_arrays():
  out = validate.token_ids([[1, 2], [3, 4]], 8, 'f', ndim=2)
  assert isinstance(out, np.ndarray) and out.dtype == np.int32 and out.tolist() == [[1, 2],
                                                                                  [3, 4]]
  dev = jnp.asarray([[1, 2]], jnp.int32)
  assert validate.token_ids(dev, 8, 'f', ndim=2) is dev
  assert validate.token_ids(np.array([7], np.int64), 8, 'f', ndim=1).dtype == np.int32


def test_token_ids_under_jit_checks_the_dtype_only():
  seen = []

  @jax.jit
  def f(t):
    seen.append(validate.token_ids(t, 8, 'f') is t)
    return t

  f(jnp.asarray([[100]], jnp.int32))  # out of range, unknown while tracing: passes
  assert seen == [True]
  with pytest.raises(ValueError, match='must be integers, got dtype float32'):
    jax.jit(lambda t: validate.token_ids(t, 8, 'f'))(jnp.ones((1, 2)))


def test_a_device_array_is_range_checked_only_when_asked():
  dev = jnp.asarray([[1, 9]], jnp.int32)
  assert validate.token_ids(dev, 8, 'f', check_values=False) is dev
  with pytest.raises(ValueError, match=r'f: token id 9 at index \(0, 1\)'):
    validate.token_ids(dev, 8, 'f')


@pytest.mark.parametrize('value,ok', [(3, True), (np.int64(3), True), (0, False),
                                      (2.0, False), (True, False), ('3', False)])
def test_count(value, ok):
  if ok:
    assert validate.count(value, 'n', 'f') == 3
  else:
    with pytest.raises(ValueError, match=r'f: n=.* must be an int >= 1'):
      validate.count(value, 'n', 'f')


def test_string_and_int_tuples():
  assert validate.string_tuple(['a', 'bc'], 's', 'f') == ('a', 'bc')
  for bad in ('ab', b'ab', ['a', ''], [1], 3):
    with pytest.raises(ValueError, match='f: s'):
      validate.string_tuple(bad, 's', 'f')
  assert validate.int_tuple(np.array([1, 2]), 't', 'f') == (1, 2)
  for bad in (5, [1.5], [-1], [True], 'ab'):
    with pytest.raises(ValueError, match='f: t'):
      validate.int_tuple(bad, 't', 'f')


def test_in_jit_helpers():
  tokens_BT = jnp.asarray([[1, 2, 9], [1, 2, 3], [9, 0, 0]])
  ok_B = validate.ids_in_range(tokens_BT, 8, num_real=2)  # row 0's 9 is padding
  assert ok_B.tolist() == [True, True, False]
  logits_BV = jnp.asarray([[0.0, 1.0], [jnp.nan, 0.0], [jnp.inf, 0.0], [-jnp.inf, -jnp.inf]])
  assert validate.finite_rows(logits_BV).tolist() == [True, False, False, False]
  tok_B = validate.mark_non_finite(jnp.asarray([1, 1, 1, 1]), logits_BV)
  assert tok_B.tolist() == [1, validate.NON_FINITE, validate.NON_FINITE, validate.NON_FINITE]
  assert np.isnan(np.asarray(validate.poison_rows(jnp.ones((2, 3)), jnp.asarray([True, False])))
                  ).tolist() == [[False] * 3, [True] * 3]
  with pytest.raises(FloatingPointError, match='loop: the logits of row 1 at generated token 2'):
    validate.raise_non_finite(np.asarray([[5, 1, 1, 1], [5, 1, 1, -1]]), 'loop', start=1)


def test_ids_past_int64_and_strings_are_named():
  with pytest.raises(ValueError, match=r'f: token id 1180591620717411303424 is outside the '
                                       r'vocabulary \[0, 8\)'):
    validate.token_ids([1, 2**70], 8, 'f')
  with pytest.raises(ValueError, match=r"f: token id 'a' is not an integer"):
    validate.token_ids(['a'], 8, 'f')
  assert validate.token_ids(np.array([1, 2], object), 8, 'f').tolist() == [1, 2]
