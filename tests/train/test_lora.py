"""LoRA / QLoRA adapters: init leaves logits unchanged, only adapters train, the frozen base is
bit-identical, merge == base + adapters, the frozen-quantized VJP, save / load with a base
hash, and the errors (rank too large, a rule matching nothing, the embedding, W8A8 bases)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax.core import QFormat, dequantize, int_format, qeinsum, quantize
from qjax.nn import (QuantPolicy, QuantRule, Transformer, TransformerConfig, apply_fake_quant,
                     einsum_layers, quantize_model)
from qjax.train import lora, lora_core, lora_io, make_optimizer

CFG = TransformerConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1,
                        head_dim=32, d_ff=64, max_len=32)
INT4 = QuantPolicy((QuantRule('embed', exempt=True),
                    QuantRule('.*', QFormat(bits=4, group_size=32))))
ATTN_MLP = lora.AdapterPolicy((lora.AdapterRule(r'layers/\d+/attn/(q|v|o)_proj', rank=4),
                               lora.AdapterRule(r'layers/\d+/mlp/down_proj', rank=2,
                                                alpha=4.0)))


@pytest.fixture(scope='module')
def float_model():
  return Transformer(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope='module')
def tokens():
  return jax.random.randint(jax.random.key(1), (4, 17), 0, CFG.vocab_size)


def _int4(model, path='auto'):
  pol = QuantPolicy(INT4.rules, path=path)
  return quantize_model(model, pol)[0]


def _logits(m, tokens_BT):
  return np.asarray(nnx.jit(lambda m, t: m(t))(m, tokens_BT))


def _base_arrays(m):
  return [np.asarray(a) for a in jax.tree.leaves(nnx.state(m, nnx.Not(nnx.LoRAParam)))]


# ---- math ------------------------------------------------------------------------------------
def test_delta_equals_the_merged_weight_product():
  """x . (w + s A B) == x . w + lora_delta for every projection layout (independent einsum)."""
  for spec, shape in (('BTD,DNH->BTNH', (8, 2, 4)), ('BTNH,NHD->BTD', (2, 4, 8)),
                      ('BTF,FD->BTD', (6, 8))):
    xs, ws = lora_core.split_letters(spec)[:2]
    sizes = dict(zip(ws, shape))
    rng = np.random.default_rng(0)
    x = rng.normal(size=tuple(sizes.get(c, 3) for c in xs)).astype(np.float32)
    w = rng.normal(size=shape).astype(np.float32)
    a_shape, b_shape = lora_core.adapter_shapes(spec, shape, 2)
    a = rng.normal(size=a_shape).astype(np.float32)
    b = rng.normal(size=b_shape).astype(np.float32)
    # numpy reference: A B laid out as the weight, by reshaping to a matrix.
    n_in = int(np.prod(a_shape[:-1]))
    ab = (a.reshape(n_in, 2) @ b.reshape(2, -1)).reshape(a_shape[:-1] + b_shape[1:])
    order = [(lora_core.split_letters(spec)[3] + lora_core.split_letters(spec)[4]).index(c)
             for c in ws]
    want = np.einsum(spec.replace('->', '->'), x, w + 0.5 * np.transpose(ab, order))
    got = jnp.einsum(spec, x, w) + lora_core.lora_delta(spec, x, a, b, 0.5)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(lora_core.merged_weight(spec, w, a, b, 0.5),
                               w + 0.5 * np.transpose(ab, order), rtol=1e-5, atol=1e-5)
    assert lora_core.max_rank(spec, shape) == min(n_in, int(np.prod(b_shape[1:])))


def test_frozen_qeinsum_gradient_is_dy_times_dequantized_weight():
  """The custom VJP equals autodiff through the dequantized weight; the weight gets none."""
  w = quantize(jax.random.normal(jax.random.key(0), (64, 16)), int_format(4, group_size=32))
  x = jax.random.normal(jax.random.key(1), (3, 5, 64))
  f = lambda x: jnp.sum(jnp.sin(lora_core.frozen_qeinsum('BTD,DF->BTF', x, w, path='dequant')))
  ref = lambda x: jnp.sum(jnp.sin(jnp.einsum('BTD,DF->BTF', x, dequantize(w))))
  np.testing.assert_allclose(jax.grad(f)(x), jax.grad(ref)(x), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(
      lora_core.frozen_qeinsum('BTD,DF->BTF', x, w), qeinsum('BTD,DF->BTF', x, w))


# ---- adapters on a model ---------------------------------------------------------------------
def test_init_leaves_logits_unchanged_and_the_base_hash_is_the_base(float_model, tokens):
  """B = 0: every adapter adds exactly 0, so the adapted int4 model's logits equal the base's
  (to the rounding of a differently fused program); wrapping keeps the base's content hash;
  the report counts the adapters' parameters."""
  base = _int4(float_model)
  ref, h = _logits(base, tokens[:, :-1]), lora_io.base_sha256(base)
  model, report = lora.apply_adapters(base, ATTN_MLP, rngs=nnx.Rngs(1))
  x = jax.random.normal(jax.random.key(4), (2, 3, 64))
  for _, w in lora.adapter_layers(model):
    if w.lora_a is not None:
      xin = x[..., :w.lora_a.shape[0]] if w.lora_a.ndim == 2 else x[..., :w.lora_a.shape[1]
                                                                      ].reshape(2, 3, 1, -1)
      if w.lora_a.ndim == 3:
        xin = jnp.broadcast_to(xin, (2, 3) + w.lora_a.shape[:2])
      assert not np.any(np.asarray(lora_core.lora_delta(w.spec, xin, w.lora_a[...],
                                                        w.lora_b[...], w.scale)))
  np.testing.assert_allclose(_logits(model, tokens[:, :-1]), ref, rtol=0, atol=1e-5)
  assert lora_io.base_sha256(model) == h
  # q: 32x4 + 4x(2*32); v: 32x4 + 4x32; o: 64x4 + 4x32; down: 64x2 + 2x32; two layers.
  assert report.trainable_params == 2 * ((128 + 256) + (128 + 128) + (256 + 128) + (128 + 64))
  assert lora.trainable_params(model) == report.trainable_params
  assert len(report.adapted) == 8 and len(report.frozen) == 2 * 7 - 8


def test_training_moves_only_adapters_lowers_loss_and_merges(float_model, tokens):
  """A few steps on a packed-int4 base: loss falls, base arrays bit-identical, the merged
  float model equals base + adapters, its re-quantization reloads bit for bit."""
  base = _int4(float_model, path='dequant')  # exact products: merged == adapted to rounding
  before = _base_arrays(base)
  model, _ = lora.apply_adapters(base, ATTN_MLP, rngs=nnx.Rngs(1))
  opt = lora.make_lora_optimizer(model, make_optimizer(3e-2, 8, 1, weight_decay=0.0))
  losses = [float(lora.lora_step(model, opt, tokens)) for _ in range(6)]
  assert losses[-1] < losses[0] - 0.05, losses
  after = [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Not(nnx.LoRAParam)))]
  assert len(after) == len(before)
  for a, b in zip(before, after):
    np.testing.assert_array_equal(a, b)
  assert any(np.abs(np.asarray(v)).max() > 0 for v in
             jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
  # Merge: a float model, plain Einsums at the original paths, same function.
  merged = lora.merge_adapters(model)
  assert [p for p, _ in einsum_layers(merged)] == [p for p, _ in einsum_layers(float_model)]
  assert not any(l.quantized for _, l in einsum_layers(merged))
  np.testing.assert_allclose(_logits(merged, tokens[:, :-1]), _logits(model, tokens[:, :-1]),
                             rtol=1e-4, atol=1e-4)
  # The adapted model's base is untouched by the merge (it is a copy).
  for a, b in zip(before, _base_arrays(model)):
    np.testing.assert_array_equal(a, b)
  # Saved alone and loaded onto the same base: the same logits; onto another base: refused.
  import tempfile  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as d:
    lora_io.save_adapters(d, model, ATTN_MLP)
    again, record = lora_io.load_adapters(d, _int4(float_model, path='dequant'))
    for x, y in zip(jax.tree.leaves(nnx.state(again, nnx.LoRAParam)),
                    jax.tree.leaves(nnx.state(model, nnx.LoRAParam))):
      np.testing.assert_array_equal(x, y)
    assert record['base_sha256'] == lora_io.base_sha256(base)
    # The same model unquantized, or quantized on another path or format, is another base.
    with pytest.raises(ValueError, match='trained on base'):
      lora_io.load_adapters(d, Transformer(CFG, rngs=nnx.Rngs(0)))
    other = quantize_model(float_model, QuantPolicy(
        (QuantRule('embed', exempt=True), QuantRule('.*', QFormat(bits=4, group_size=16))),
        path='dequant'))[0]
    with pytest.raises(ValueError, match='trained on base'):
      lora_io.load_adapters(d, other)


def test_fake_quantized_base_merges_to_what_the_forward_sees(float_model, tokens):
  """On a fake-quantized (QAT) base, merged == adapted: the merge adds A B to the
  fake-quantized weight (adapters set to random values, so they change the logits)."""
  fake, _ = apply_fake_quant(float_model, INT4)
  before = _logits(fake, tokens[:, :-1])
  model, _ = lora.apply_adapters(fake, ATTN_MLP, rngs=nnx.Rngs(2))
  for _, w in lora.adapter_layers(model):
    if w.lora_b is not None:
      w.lora_b.set_value(0.1 * jax.random.normal(jax.random.key(3), w.lora_b.shape))
  got = _logits(model, tokens[:, :-1])
  assert np.abs(got - before).max() > 1e-2
  merged = lora.merge_adapters(model)
  adapted = {p for p, w in lora.adapter_layers(model) if w.lora_a is not None}
  for p, l in einsum_layers(merged):  # merged weights are new floats; the rest keep QAT
    assert (l.quant.fake_fmt is None) == (p in adapted or p == 'embed'), p
  np.testing.assert_allclose(_logits(merged, tokens[:, :-1]), got, rtol=1e-4, atol=1e-4)


def test_remat_gives_the_same_gradient(float_model, tokens):
  """Per-block nnx.remat recomputes the forward in the backward: the same adapter gradient."""
  model, _ = lora.apply_adapters(nnx.clone(float_model), ATTN_MLP, rngs=nnx.Rngs(1))

  @nnx.jit
  def grads(model, tokens):
    g = lambda remat: nnx.grad(lora.lora_loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(
        model, tokens, remat)
    return g(False), g(True)

  plain, remat = grads(model, tokens)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert max(float(jnp.abs(a).max()) for a in jax.tree.leaves(plain)) > 0


def test_dropout_acts_in_training_only():
  """Dropout on the adapter's input: random in train mode, off in eval mode (then the layer
  is base + delta exactly)."""
  from qjax.nn.layers import Einsum  # pylint: disable=g-import-not-at-top
  base = Einsum('BTD,DF->BTF', (16, 8), ('embed', 'mlp'), rngs=nnx.Rngs(0))
  layer = lora.LoRAEinsum(base, lora.AdapterRule('x', rank=2, dropout=0.5), 'x',
                          rngs=nnx.Rngs(1))
  layer.lora_b.set_value(jnp.ones((2, 8)))
  x = jax.random.normal(jax.random.key(2), (2, 3, 16))
  want = jnp.einsum('BTD,DF->BTF', x, lora_core.merged_weight(
      'BTD,DF->BTF', base.w[...], layer.lora_a[...], layer.lora_b[...], layer.scale))
  layer.train()
  a, b = layer(x), layer(x)
  assert np.abs(np.asarray(a - b)).max() > 1e-3  # two draws of the mask
  layer.eval()
  np.testing.assert_allclose(layer(x), want, rtol=1e-5, atol=1e-5)


# ---- errors ----------------------------------------------------------------------------------
def test_bad_policies_are_refused_with_the_fix(float_model):
  with pytest.raises(ValueError, match='rank=64 .* larger than layer .*use rank <= 32'):
    lora.apply_adapters(nnx.clone(float_model),
                        lora.AdapterPolicy((lora.AdapterRule(r'.*/v_proj', rank=64),)),
                        rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='matched no layer.*qproj'):
    lora.apply_adapters(nnx.clone(float_model),
                        lora.AdapterPolicy((lora.AdapterRule(r'layers/\d+/attn/q_proj'),
                                            lora.AdapterRule(r'layers/\d+/attn/qproj'))),
                        rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='embedding'):
    lora.apply_adapters(nnx.clone(float_model), lora.AdapterPolicy((lora.AdapterRule('.*'),)),
                        rngs=nnx.Rngs(0))
  w8a8 = quantize_model(float_model, QuantPolicy((QuantRule('embed', exempt=True),
                                                  QuantRule('.*', int_format(8),
                                                            act=int_format(8)))))[0]
  with pytest.raises(ValueError, match='weight-only'):
    lora.apply_adapters(w8a8, ATTN_MLP, rngs=nnx.Rngs(0))
  for bad, match in (({'rank': 0}, 'rank=0'), ({'alpha': -1.0}, 'alpha=-1.0'),
                     ({'dropout': 1.0}, 'dropout=1.0'), ({'init': 'zeros'}, 'init=')):
    with pytest.raises(ValueError, match=match):
      lora.AdapterRule('.*', **bad)
  model, _ = lora.apply_adapters(nnx.clone(float_model), ATTN_MLP, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='already has adapters'):
    lora.apply_adapters(model, ATTN_MLP, rngs=nnx.Rngs(0))
