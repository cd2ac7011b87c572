"""Memory per chip of a training step: weights, gradients, optimizer state, activations.

A data + model parallel layout splits the batch over `data` chips and every weight matrix
(and its gradient and optimizer state) over all chips (`n`), as a fully sharded data
parallel layout does; activations are split over the batch's chips and their features over
the `n / data` model chips. Counted per chip:
  weights      params * weight bits / n (the float master copy);
  gradients    one layer's (layer params * grad bits / n): with the weights and optimizer
               state donated, the compiler applies each weight's update as soon as its
               gradient is complete, so a whole model's gradients are never live at once
               where memory is short (a compiled Llama-3-8B step: docs/costmodel.md);
  optimizer    params * state bits / n (Adam: two float32 moments);
  activations  what the backward pass keeps per layer and token, without rematerialisation:
               the residual stream and the two norms' outputs (3 E), queries, keys, values
               and the attention output ((2 N + 2 K) H), the MLP's gate, up, activation and
               product (4 F), and the block outputs (2 E), in the compute dtype, each feature
               dim split over the model chips; plus float32 logits of every position and
               their gradient over the vocabulary split across the model chips.
"""

from __future__ import annotations

import dataclasses

from qjax.costmodel import _layouts
from qjax.costmodel import _models


@dataclasses.dataclass(frozen=True)
class TrainMemory:
  """Bytes per chip of one training step (module docstring)."""

  weights_bytes: float
  grad_bytes: float
  optimizer_bytes: float
  activation_bytes: float

  @property
  def total_bytes(self) -> float:
    return self.weights_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


def train_memory(model, mesh, *, batch: int, seq_len: int, data_axes=('x',),
                 weight_bits: float = 32, grad_bits: float = 32, state_bits: float = 64,
                 act_bits: float = 16) -> TrainMemory:
  """Predicted memory per chip of one training step (module docstring).

  Args:
    model: a `ModelShape` or preset name.
    mesh: the chip mesh ('2x4x1', a Mesh).
    batch: sequences per step.
    seq_len: tokens per sequence.
    data_axes: the mesh axes the batch is split over (the rest split the features).
    weight_bits, grad_bits: bits per stored weight and per gradient (32: float32).
    state_bits: optimizer state bits per weight (Adam's two float32 moments: 64).
    act_bits: bits per saved activation (the compute dtype).

  Returns:
    A `TrainMemory`.

  Raises:
    ValueError: a batch the data axes do not divide.
  """
  m, mesh = _models.model_from_spec(model), _layouts.as_mesh(mesh)
  data = mesh.size(tuple(data_axes))
  if batch % data:
    raise ValueError(f'train_memory: batch={batch} is split over {"*".join(data_axes)}={data} '
                     f'chips; use a batch that is a multiple of {data}.')
  model_chips = mesh.n // data
  p, n = m.n_params, mesh.n
  tokens = batch // data * seq_len
  e, f, h = m.d_model, m.d_ff, m.head_dim
  per_token_layer = (5 * e + 4 * f + (2 * m.n_heads + 2 * m.n_kv_heads) * h) / model_chips
  logits = 2 * tokens * m.vocab / model_chips * 4
  acts = m.n_layers * tokens * per_token_layer * act_bits / 8 + logits
  grads = max(m.layer_params, m.head_params) * grad_bits / 8 / n
  return TrainMemory(weights_bytes=p * weight_bits / 8 / n, grad_bytes=grads,
                     optimizer_bytes=p * state_bits / 8 / n, activation_bytes=acts)
