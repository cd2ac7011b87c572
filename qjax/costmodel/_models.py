"""Transformer shapes for the cost model: parameter counts and KV-cache bytes.

Dimension letters follow the qjax glossary: E d_model, F d_ff, N query heads, K kv heads,
H head dim, V vocab. Norm and bias parameters are ignored (< 0.01% of any preset here).
"""

from __future__ import annotations

import dataclasses
import math

from qjax.costmodel import _names


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """The shape of a decoder-only transformer.

  Attributes:
    name: preset name.
    n_layers: transformer layers.
    d_model: E.
    d_ff: F, the hidden width of the feed-forward block.
    n_heads: N query heads.
    head_dim: H.
    n_kv_heads: K key/value heads (1 = multiquery, N = multihead, between = grouped).
    vocab: V.
    glu: gated feed-forward (SwiGLU/GeGLU): three E x F matrices instead of two.
    tied_embeddings: the input embedding is reused as the output projection.
    parallel_block: attention and feed-forward read the same normalised input and their
      outputs are summed (PaLM), so a layer needs one input all-gather and one output
      reduce-scatter instead of two of each (Pope et al. sec. 3.4).
  """

  name: str
  n_layers: int
  d_model: int
  d_ff: int
  n_heads: int
  head_dim: int
  n_kv_heads: int
  vocab: int
  glu: bool = False
  tied_embeddings: bool = True
  parallel_block: bool = False

  def __post_init__(self):
    for field in ('n_layers', 'd_model', 'd_ff', 'n_heads', 'head_dim', 'n_kv_heads', 'vocab'):
      value = getattr(self, field)
      if not (isinstance(value, int) and value > 0):
        raise ValueError(f'ModelShape {self.name!r}: {field} must be a positive int, '
                         f'got {value!r}.')

  @property
  def n_ffn_matrices(self) -> int:
    return 3 if self.glu else 2

  @property
  def attn_params_per_layer(self) -> int:
    """Q, K, V and output projections of one layer."""
    e, h = self.d_model, self.head_dim
    return e * h * (2 * self.n_heads + 2 * self.n_kv_heads)

  @property
  def ffn_params_per_layer(self) -> int:
    return self.n_ffn_matrices * self.d_model * self.d_ff

  @property
  def layer_params(self) -> int:
    return self.attn_params_per_layer + self.ffn_params_per_layer

  @property
  def embed_params(self) -> int:
    """Embedding tables: one V x E table if tied, two otherwise."""
    return self.vocab * self.d_model * (1 if self.tied_embeddings else 2)

  @property
  def n_params(self) -> int:
    """All parameters; the N in MFU = 2 N tokens / (chips * peak * time)."""
    return self.n_layers * self.layer_params + self.embed_params

  @property
  def head_params(self) -> int:
    """The output projection (V x E), the only embedding matrix used in a matmul."""
    return self.vocab * self.d_model

  def kv_bytes_per_token(self, kv_bits: float = 16) -> float:
    """KV-cache bytes one token of one sequence occupies over all layers: 2 K H layers b/8,
    plus, below 16 bits, one float32 scale per token, kv head and layer for K and for V
    (qjax's quantized caches)."""
    return (2 * self.n_kv_heads * self.head_dim * self.n_layers * kv_bits / 8
            + self.kv_scale_bytes_per_token(kv_bits))

  def kv_scale_bytes_per_token(self, kv_bits: float) -> float:
    """The float32 scales of a quantized cache: one per token, kv head and layer, K and V."""
    return 2 * self.n_kv_heads * self.n_layers * 4 if kv_bits < 16 else 0.0

  def kv_cache_bytes(self, batch: int, seq_len: int, kv_bits: float = 16) -> float:
    """KV-cache bytes for `batch` sequences of `seq_len` tokens (seed 000, sec. 4.2)."""
    return batch * seq_len * self.kv_bytes_per_token(kv_bits)

  def weight_bytes(self, weight_bits: float = 16) -> float:
    """Bytes of all weights stored at `weight_bits` bits (scales not counted)."""
    return self.n_params * weight_bits / 8

  def padded(self, multiple: int) -> 'ModelShape':
    """A copy with query heads rounded up to a multiple of `multiple`.

    Pope et al. (sec. 4) padded PaLM 540B from 48 to 64 heads to shard them over 64 chips
    (+18B parameters, ~3% MFU); the padded heads cost time and memory but do no useful work.
    """
    n_heads = math.ceil(self.n_heads / multiple) * multiple
    return dataclasses.replace(self, n_heads=n_heads)

  def padded_kv(self, multiple: int) -> 'ModelShape':
    """A copy with kv heads rounded up to a multiple of `multiple` (and query heads to at
    least as many), so a heads-sharded cache splits evenly; the padded heads cost cache
    memory, bandwidth and projection weights but do no useful work."""
    n_kv = math.ceil(self.n_kv_heads / multiple) * multiple
    n_heads = max(self.n_heads, n_kv)
    n_heads = math.ceil(n_heads / n_kv) * n_kv
    return dataclasses.replace(self, n_kv_heads=n_kv, n_heads=n_heads)


@dataclasses.dataclass(frozen=True)
class TotalsShape(ModelShape):
  """A model known only by totals: parameter count and KV-cache bytes per token.

  The per-layer shape fields still say how wide activations are (for communication and
  attention FLOPs); the parameter count and the cache size come from the totals instead.

  Attributes:
    total_params: all parameters (embeddings included).
    total_kv_bytes_per_token: KV-cache bytes one token of one sequence takes over all layers
      at 16 bits per element (scaled by kv_bits / 16).
  """

  total_params: int = 0
  total_kv_bytes_per_token: float = 0.0

  def __post_init__(self):
    super().__post_init__()
    if not (isinstance(self.total_params, int) and self.total_params > self.embed_params):
      raise ValueError(f'ModelShape {self.name!r}: n_params={self.total_params!r} must be an int '
                       f'larger than the embedding (vocab x d_model = {self.embed_params}).')
    if not self.total_kv_bytes_per_token > 0:
      raise ValueError(f'ModelShape {self.name!r}: kv_bytes_per_token='
                       f'{self.total_kv_bytes_per_token!r} must be > 0 (bytes at 16 bits).')

  @property
  def layer_params(self) -> float:
    return (self.total_params - self.embed_params) / self.n_layers

  @property
  def n_params(self) -> int:
    return self.total_params

  def kv_bytes_per_token(self, kv_bits: float = 16) -> float:
    return self.total_kv_bytes_per_token * kv_bits / 16 + self.kv_scale_bytes_per_token(kv_bits)

  def padded(self, multiple: int) -> 'ModelShape':
    return self  # a totals model has no heads to pad: its totals are what they are

  def padded_kv(self, multiple: int) -> 'ModelShape':
    return self


_SHAPE_FIELDS = ('n_layers', 'd_model', 'd_ff', 'n_heads', 'head_dim', 'n_kv_heads', 'vocab',
                 'glu', 'tied_embeddings', 'parallel_block')


def model_from_spec(spec) -> ModelShape:
  """A preset name, a `ModelShape`, or a mapping describing a custom model.

  A mapping gives either the shape ({'name', 'n_layers', 'd_model', 'd_ff', 'n_heads',
  'head_dim', 'n_kv_heads', 'vocab', optional 'glu', 'tied_embeddings', 'parallel_block'}) or
  totals ({'n_params', 'kv_bytes_per_token' (at 16 bits), 'n_layers', 'd_model', optional
  'vocab' (default 1), 'd_ff' (default 4 d_model), 'n_heads', 'head_dim'}).

  Raises:
    ValueError: an unknown preset, an unknown key, or a missing one (named).
  """
  if isinstance(spec, (str, ModelShape)):
    return get_model(spec)
  spec = dict(spec)
  name = spec.pop('name', 'custom')
  if 'n_params' in spec or 'kv_bytes_per_token' in spec:
    allowed = {'n_params', 'kv_bytes_per_token', 'n_layers', 'd_model', 'vocab', 'd_ff',
               'n_heads', 'head_dim', 'n_kv_heads', 'glu', 'tied_embeddings', 'parallel_block'}
    need = ('n_params', 'kv_bytes_per_token', 'n_layers', 'd_model')
  else:
    allowed, need = set(_SHAPE_FIELDS), _SHAPE_FIELDS[:7]
  unknown = sorted(set(spec) - allowed)
  if unknown:
    raise ValueError(f'custom model {name!r}: unknown key(s) {unknown}; allowed: '
                     f'{sorted(allowed)}.')
  missing = [k for k in need if k not in spec]
  if missing:
    raise ValueError(f'custom model {name!r}: missing {missing} (a shape needs '
                     f'{list(_SHAPE_FIELDS[:7])}; totals need n_params, kv_bytes_per_token, '
                     'n_layers, d_model).')
  if 'n_params' not in spec:
    return ModelShape(name, **spec)
  d = spec['d_model']
  head_dim = spec.pop('head_dim', 128)
  return TotalsShape(name, n_layers=spec['n_layers'], d_model=d, d_ff=spec.get('d_ff', 4 * d),
                     n_heads=spec.get('n_heads', max(1, d // head_dim)), head_dim=head_dim,
                     n_kv_heads=spec.get('n_kv_heads', 1), vocab=spec.get('vocab', 1),
                     glu=spec.get('glu', False), tied_embeddings=spec.get('tied_embeddings', True),
                     parallel_block=spec.get('parallel_block', False),
                     total_params=spec['n_params'],
                     total_kv_bytes_per_token=float(spec['kv_bytes_per_token']))


# PaLM: Chowdhery et al. 2022, Table 1 (SwiGLU, multiquery, parallel block, shared embeddings,
# d_ff = 4 d_model, vocab 256k). n_params: 8.63B, 62.50B, 540.35B.
# Llama 2 13B, Llama 3 8B / 70B: their Hugging Face config.json files (SwiGLU, untied output
# embedding, serial block; Llama 3 has 8 kv heads (GQA)). n_params: 13.0B, 8.03B, 70.6B.
# Gemma 3 270M: its GGUF's metadata (as qjax.checkpoints.gguf_config reads it): 18 layers,
# d_model 640, d_ff 2048 GeGLU, 4 query heads sharing 1 kv head of 256, vocab 262,144,
# serial block.
MODELS = {
    'palm_8b': ModelShape('palm_8b', n_layers=32, d_model=4096, d_ff=16384, n_heads=16,
                          head_dim=256, n_kv_heads=1, vocab=256128, glu=True,
                          parallel_block=True),
    'palm_62b': ModelShape('palm_62b', n_layers=64, d_model=8192, d_ff=32768, n_heads=32,
                           head_dim=256, n_kv_heads=1, vocab=256128, glu=True,
                           parallel_block=True),
    'palm_540b': ModelShape('palm_540b', n_layers=118, d_model=18432, d_ff=73728, n_heads=48,
                            head_dim=256, n_kv_heads=1, vocab=256128, glu=True,
                            parallel_block=True),
    'llama2_13b': ModelShape('llama2_13b', n_layers=40, d_model=5120, d_ff=13824, n_heads=40,
                             head_dim=128, n_kv_heads=40, vocab=32000, glu=True,
                             tied_embeddings=False),
    'llama3_8b': ModelShape('llama3_8b', n_layers=32, d_model=4096, d_ff=14336, n_heads=32,
                            head_dim=128, n_kv_heads=8, vocab=128256, glu=True,
                            tied_embeddings=False),
    'llama3_70b': ModelShape('llama3_70b', n_layers=80, d_model=8192, d_ff=28672, n_heads=64,
                             head_dim=128, n_kv_heads=8, vocab=128256, glu=True,
                             tied_embeddings=False),
    'gemma3_270m': ModelShape('gemma3_270m', n_layers=18, d_model=640, d_ff=2048, n_heads=4,
                              head_dim=256, n_kv_heads=1, vocab=262144, glu=True),
}


def get_model(model: 'str | ModelShape') -> ModelShape:
  """Returns a model preset by name (e.g. 'palm_540b'); a `ModelShape` passes through."""
  if isinstance(model, ModelShape):
    return model
  return _names.lookup('model preset', model, MODELS)
