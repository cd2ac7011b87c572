"""The training-step memory planner: golden numbers for a small shape, and its errors."""

import pytest

from qjax import costmodel

TOY = costmodel.ModelShape('toy', n_layers=2, d_model=128, d_ff=512, n_heads=4, head_dim=32,
                           n_kv_heads=2, vocab=1000, glu=True, tied_embeddings=False)


def test_golden_bytes_per_chip():
  m = costmodel.train_memory(TOY, '2x4x1', batch=4, seq_len=16)
  n = 8
  params = TOY.n_params  # 2 * (3*128*512 + 128*32*(8+4)) + 2*1000*128 = 747,520
  assert params == 747_520
  assert m.weights_bytes == params * 4 / n
  assert m.optimizer_bytes == params * 8 / n  # Adam's two float32 moments
  assert m.grad_bytes == max(TOY.layer_params, TOY.head_params) * 4 / n  # one layer's, live
  tokens = 4 // 2 * 16  # the batch split over x
  per_token_layer = (5 * 128 + 4 * 512 + (8 + 4) * 32) / 4  # features over the 4 model chips
  logits = 2 * tokens * 1000 / 4 * 4
  assert m.activation_bytes == pytest.approx(2 * tokens * per_token_layer * 2 + logits)
  assert m.total_bytes == pytest.approx(m.weights_bytes + m.grad_bytes + m.optimizer_bytes
                                        + m.activation_bytes)


def test_batch_that_the_data_axes_cannot_split():
  with pytest.raises(ValueError, match='multiple of 2'):
    costmodel.train_memory(TOY, '2x4x1', batch=3, seq_len=16)
