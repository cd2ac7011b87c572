"""True bit packing of signed integer codes along the last axis.

Layouts (all little-endian within a byte, codes stored in two's complement):

* 4-bit: two codes per uint8; code `2i` in the low nibble, `2i+1` in the high nibble.
* 2-bit: four codes per uint8; code `4i+j` in bits `2j..2j+1`.
* 3-bit: eight codes in three uint8 bytes; code `8i+j` in bits `3j..3j+2` of the 24-bit
  little-endian word formed by bytes `3i, 3i+1, 3i+2`.

Packing is along the *last* axis and pairs neighbouring elements, so an array sharded along
its last axis (with an even shard size) unpacks shard-locally. An odd last dimension is padded
with zero codes up to a whole byte group; `unpack` drops the padding, and `nbytes` counts it
because the device holds it. 5-, 6- and 8-bit codes are stored one per int8 byte.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# bits -> (codes per group, bytes per group)
GROUPS = {2: (4, 1), 3: (8, 3), 4: (2, 1)}


def packed_length(n: int, bits: int) -> int:
  """Bytes along the last axis that `n` codes of `bits` occupy after packing."""
  if bits not in GROUPS:
    return n
  per, nbytes = GROUPS[bits]
  return -(-n // per) * nbytes


def pack(codes: jax.Array, bits: int) -> jax.Array:
  """Pack int8 codes of `bits` (2, 3 or 4) along the last axis into uint8.

  Args:
    codes: int8 array of signed codes in [-2**(bits-1), 2**(bits-1) - 1].
    bits: 2, 3 or 4.

  Returns:
    uint8 array whose last dimension is `packed_length(codes.shape[-1], bits)`.
  """
  if bits not in GROUPS:
    raise ValueError(f'pack: bits={bits} has no packed layout; packed widths are 2, 3, 4.')
  per, nbytes = GROUPS[bits]
  n = codes.shape[-1]
  pad = -n % per
  if pad:
    codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, pad)])
  mask = (1 << bits) - 1
  c = (codes.astype(jnp.int32) & mask).reshape(codes.shape[:-1] + (-1, per))
  shifts = jnp.arange(per, dtype=jnp.int32) * bits
  word = jnp.sum(c << shifts, axis=-1)  # disjoint bit fields: sum == bitwise or
  if nbytes == 1:
    return word.astype(jnp.uint8)
  byte_shifts = jnp.arange(nbytes, dtype=jnp.int32) * 8
  out = ((word[..., None] >> byte_shifts) & 0xFF).astype(jnp.uint8)
  return out.reshape(codes.shape[:-1] + (-1,))


def unpack_fields(packed: jax.Array, bits: int) -> list[jax.Array]:
  """The codes of `packed` as `per` int8 arrays without interleaving them.

  Field `j` holds codes `j, j + per, j + 2 per, ...` of the last axis (`per` = 2 for 4-bit, 4
  for 2-bit, 8 for 3-bit), including any padding codes. Each field is a few elementwise ops
  on the bytes that XLA fuses into its consumer; interleaving them back into one array (what
  `unpack` does) is the slow part of unpacking on CPU, so matmuls consume the fields directly.
  """
  if bits not in GROUPS:
    raise ValueError(f'unpack: bits={bits} has no packed layout; packed widths are 2, 3, 4.')
  per, nbytes = GROUPS[bits]
  if nbytes == 1:
    # Sign-extend each field with an int8 shift-left then arithmetic shift-right.
    p = lax.bitcast_convert_type(packed, jnp.int8)
    return [
        lax.shift_right_arithmetic(lax.shift_left(p, jnp.int8(8 - bits * (j + 1))),
                                   jnp.int8(8 - bits)) for j in range(per)
    ]
  b = packed.astype(jnp.int32).reshape(packed.shape[:-1] + (-1, nbytes))
  word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
  return [
      lax.shift_right_arithmetic(lax.shift_left(word, 32 - bits * (j + 1)), 32 - bits)
      .astype(jnp.int8) for j in range(per)
  ]


def unpack(packed: jax.Array, bits: int, n: int) -> jax.Array:
  """Inverse of `pack`: uint8 bytes -> int8 codes with last dimension `n`."""
  fields = unpack_fields(packed, bits)
  codes = jnp.stack(fields, axis=-1).reshape(packed.shape[:-1] + (-1,))
  return codes[..., :n]
