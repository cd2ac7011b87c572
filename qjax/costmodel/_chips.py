"""Accelerator presets: peak FLOP/s per number format, HBM, and interconnect bandwidth.

Units are SI: FLOP/s, bytes, bytes/s. Interconnect bandwidth `ici_bw` is what one chip can
send in one direction over all of its links together: this is the number Pope et al. (2022)
call the chip's "interconnect bandwidth" (270 GB/s on TPU v4 = 6 torus links x 45 GB/s), and
what their analytic model assumes every collective gets ("all-links" model). The per-axis
model instead gives a collective only the links of the torus axes it runs over; see
`Chip.axis_bw` and `_collectives.group_bandwidth`.

Sources (read 2026-11-29):
  TPU v4:  cloud.google.com/tpu/docs/v4 ("275 teraflops (bf16 or int8)", "32 GiB, 1200 GBps");
           Pope et al. 2022, sec. 4 (270 GB/s interconnect).
  TPU v5e: cloud.google.com/tpu/docs/v5e (197 TFLOP/s bf16, 393 TOP/s int8, 16 GB, 819 GBps,
           1600 Gbps ICI = 400 GBps bidirectional, 4 ports, 2D torus).
  TPU v6e: cloud.google.com/tpu/docs/v6e (918 TFLOP/s bf16, 1836 TOP/s int8, 32 GB, 1640
           GBps, 3584 Gbps ICI, 2D torus), read 2026-12-06.
  TPU v5p: cloud.google.com/tpu/docs/v5p (459 TFLOP/s bf16, 95 GB, 2765 GBps, 4800 Gbps ICI,
           3D torus); int8 918 TOP/s from Google's v5p announcement (2x bf16).
  H100 SXM / H200 SXM: NVIDIA datasheets (nvidia.com/en-us/data-center/h100, /h200). The
           datasheets quote tensor FLOP/s "with sparsity"; we use the dense half: bf16
           989.5 TFLOP/s, fp8 and int8 1979 T. H100 80 GB at 3.35 TB/s, H200 141 GB at
           4.8 TB/s; NVLink 4 900 GB/s bidirectional = 450 GB/s per direction through
           NVSwitch within an 8-GPU HGX board; 400 Gb/s (50 GB/s) InfiniBand per GPU beyond.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from qjax.costmodel import _names

GiB = 2**30
TOPOLOGIES = ('torus', 'switch')


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator chip, as the roofline sees it.

  Attributes:
    name: preset name.
    bf16_flops: peak dense matmul FLOP/s with 16-bit operands.
    int8_flops: peak dense int8 matmul OP/s, or None if the chip has no int8 path.
    fp8_flops: peak dense fp8 matmul FLOP/s, or None.
    hbm_bytes: HBM capacity.
    hbm_bw: HBM bandwidth, bytes/s.
    ici_bw: interconnect bandwidth, bytes/s, one direction, summed over all links.
    ici_links: links per chip (torus: 2 per axis, so 6 for a 3D torus, 4 for a 2D one).
    topology: 'torus' (neighbour links, TPUs) or 'switch' (every chip reaches every other
      through a switch at full bandwidth, NVLink/NVSwitch).
    domain_size: chips that share the fast interconnect (None: the whole pod).
    scaleout_bw: bytes/s per chip for collectives that leave the domain (None: no limit).
  """

  name: str
  bf16_flops: float
  int8_flops: Optional[float]
  fp8_flops: Optional[float]
  hbm_bytes: float
  hbm_bw: float
  ici_bw: float
  ici_links: int
  topology: str = 'torus'
  domain_size: Optional[int] = None
  scaleout_bw: Optional[float] = None

  def __post_init__(self):
    if self.topology not in TOPOLOGIES:
      raise _names.unknown_name('chip topology', self.topology, TOPOLOGIES)
    for field in ('bf16_flops', 'hbm_bytes', 'hbm_bw', 'ici_bw'):
      if not getattr(self, field) > 0:
        raise ValueError(f'Chip {self.name!r}: {field} must be > 0, got {getattr(self, field)}.')

  def peak_flops(self, compute_bits: float = 16) -> float:
    """Peak matmul FLOP/s for operands of `compute_bits` bits.

    Args:
      compute_bits: width of the matmul operands: > 8 runs on the 16-bit path; <= 8 on the
        chip's fastest 8-bit path (int8 or fp8), falling back to bf16 if it has none.

    Returns:
      FLOP/s (OP/s for int8).
    """
    if compute_bits > 8:
      return self.bf16_flops
    eight_bit = [f for f in (self.int8_flops, self.fp8_flops) if f]
    return max(eight_bit) if eight_bit else self.bf16_flops

  @property
  def axis_bw(self) -> float:
    """Bytes/s one torus axis gives a collective (its 2 links); the full port on a switch."""
    if self.topology == 'switch':
      return self.ici_bw
    return self.ici_bw * 2 / self.ici_links


CHIPS = {
    'tpu_v4': Chip('tpu_v4', bf16_flops=275e12, int8_flops=275e12, fp8_flops=None,
                   hbm_bytes=32 * GiB, hbm_bw=1200e9, ici_bw=270e9, ici_links=6),
    'tpu_v5e': Chip('tpu_v5e', bf16_flops=197e12, int8_flops=393e12, fp8_flops=None,
                    hbm_bytes=16e9, hbm_bw=819e9, ici_bw=200e9, ici_links=4),
    'tpu_v6e': Chip('tpu_v6e', bf16_flops=918e12, int8_flops=1836e12, fp8_flops=None,
                    hbm_bytes=32e9, hbm_bw=1640e9, ici_bw=448e9, ici_links=4),
    'tpu_v5p': Chip('tpu_v5p', bf16_flops=459e12, int8_flops=918e12, fp8_flops=None,
                    hbm_bytes=95e9, hbm_bw=2765e9, ici_bw=600e9, ici_links=6),
    'h100': Chip('h100', bf16_flops=989.5e12, int8_flops=1979e12, fp8_flops=1979e12,
                 hbm_bytes=80e9, hbm_bw=3.35e12, ici_bw=450e9, ici_links=18,
                 topology='switch', domain_size=8, scaleout_bw=50e9),
    'h200': Chip('h200', bf16_flops=989.5e12, int8_flops=1979e12, fp8_flops=1979e12,
                 hbm_bytes=141e9, hbm_bw=4.8e12, ici_bw=450e9, ici_links=18,
                 topology='switch', domain_size=8, scaleout_bw=50e9),
}


def get_chip(chip: 'str | Chip') -> Chip:
  """Returns a chip preset by name (e.g. 'tpu_v4', 'h200'); a `Chip` passes through."""
  if isinstance(chip, Chip):
    return chip
  return _names.lookup('chip preset', chip, CHIPS)


_CHIP_KEYS = ('bf16_flops', 'int8_flops', 'fp8_flops', 'hbm_bytes', 'hbm_bw', 'ici_bw',
              'ici_links', 'topology', 'domain_size', 'scaleout_bw')


def chip_from_spec(spec) -> Chip:
  """A preset name, a `Chip`, or a mapping describing a custom chip ({'name', 'bf16_flops',
  'hbm_bytes', 'hbm_bw', 'ici_bw', optional 'int8_flops', 'fp8_flops', 'ici_links' (default
  6), 'topology', 'domain_size', 'scaleout_bw'}; SI units: FLOP/s, bytes, bytes/s).

  Raises:
    ValueError: an unknown preset, an unknown key or a missing one (named).
  """
  if isinstance(spec, (str, Chip)):
    return get_chip(spec)
  spec = dict(spec)
  name = spec.pop('name', 'custom')
  unknown = sorted(set(spec) - set(_CHIP_KEYS))
  if unknown:
    raise ValueError(f'custom chip {name!r}: unknown key(s) {unknown}; allowed: '
                     f'{list(_CHIP_KEYS)}.')
  missing = [k for k in ('bf16_flops', 'hbm_bytes', 'hbm_bw', 'ici_bw') if k not in spec]
  if missing:
    raise ValueError(f'custom chip {name!r}: missing {missing} (FLOP/s, bytes, bytes/s).')
  spec.setdefault('int8_flops', None)
  spec.setdefault('fp8_flops', None)
  spec.setdefault('ici_links', 6)
  return Chip(name, **spec)


def critical_batch(chip: 'str | Chip', weight_bits: float = 16,
                   compute_bits: float = 16) -> float:
  """Tokens per forward pass above which a weight-streaming matmul is compute bound.

  A token costs 2 FLOPs per weight; the weight costs `weight_bits / 8` bytes to load once
  per pass. Compute time equals weight-load time at B* = peak * (weight_bits / 8) / (2 * bw),
  which is peak / bw for 16-bit weights (TPU v4: 275e12 / 1.2e12 ~ 229 tokens).

  Args:
    chip: a preset name or `Chip`.
    weight_bits: stored bits per weight.
    compute_bits: matmul operand width (selects the peak, see `Chip.peak_flops`).

  Returns:
    The critical batch in tokens (a float; round up for a batch size).
  """
  chip = get_chip(chip)
  return chip.peak_flops(compute_bits) * (weight_bits / 8) / (2 * chip.hbm_bw)
