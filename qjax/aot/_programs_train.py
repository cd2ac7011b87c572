"""A quantization-aware training step as (function, abstract arguments) (`qjax.train.qat`).

The model is prepared for QAT under the format's policy (`prepare_qat`: fake-quantized
weights with dynamic scales, recalibrated every step, W8A8 also its activations) and given
its optimizer (`make_qat_optimizer` over `make_optimizer`'s AdamW), all abstractly while the
target is in force. (Learned LSQ scales are initialised from the weights' values on the host,
which an abstract model does not have.) The program is the library's own `qat_step` on the
merged model and optimizer, the trained variables and the optimizer state donated as
`qjax.train.lean_step` donates them; bf16 trains the float model (nothing to fake-quantize).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from qjax.aot import _compile
from qjax.aot._programs import Program, compute_bits, policy
from qjax.nn import Transformer, TransformerConfig
from qjax.train import qat
from qjax.train.optim import make_optimizer


def qat_train_step(cfg: TransformerConfig, fmt: str, target: str, *, batch: int = 2,
                   length: int = 128) -> Program:
  """One QAT step on a (batch, length + 1) token batch, for `target`.

  Returns:
    A Program of (trained state, optimizer state, the rest of the model, tokens) -> (loss,
    trained state, optimizer state).
  """
  pol = policy(fmt, cfg)

  def build():
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    if pol is not None:
      model = qat.prepare_qat(model, pol, act=fmt == 'w8a8')[0]
    opt = qat.make_qat_optimizer(model, make_optimizer(1e-3, 100, 10))
    return model, opt

  with _compile.tracing_for(target):
    model, opt = nnx.eval_shape(build)
    wrt = opt.wrt
    m_def, trained, rest = nnx.split(model, wrt, ...)
    o_def, o_state = nnx.split(opt)

  def step(trained, opt_state, rest, tokens_BT1):
    m = nnx.merge(m_def, trained, rest)
    o = nnx.merge(o_def, opt_state)
    loss = qat.qat_step(m, o, tokens_BT1)
    return loss, nnx.state(m, wrt), nnx.state(o)

  tokens = jax.ShapeDtypeStruct((batch, length + 1), jnp.int32)
  return Program(f'qat_step B={batch} T={length}', step, (trained, o_state, rest, tokens),
                 donate_argnums=(0, 1), compute_bits=compute_bits(fmt), tokens=length)
