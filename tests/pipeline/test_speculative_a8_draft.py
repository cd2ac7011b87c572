"""The W4A8 / W8A8 self-draft ('int<bits>..._a8'): every weight quantized, the tied head
included, with dynamic int8 activations; still exact as a speculative draft."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qjax.core import QArray
from qjax.infer import speculative_generate
from qjax.pipeline import speculative_sweep
from qjax.nn import Transformer, TransformerConfig, greedy_generate


def test_a8_draft_quantizes_the_head_and_its_activations_and_stays_exact():
  target = Transformer(TransformerConfig.tiny(max_len=64), rngs=nnx.Rngs(0))
  draft = speculative_sweep.make_draft(target, 'int8_a8')
  assert isinstance(draft.embed.w.get_value(), QArray)  # the tied head is quantized too
  acts = {m.quant.act_fmt.name for _, m in nnx.iter_graph(draft)
          if getattr(getattr(m, 'quant', None), 'act_fmt', None) is not None}
  assert acts and all(a.startswith('int8') for a in acts), acts
  plain = speculative_sweep.make_draft(target, 'int8')
  assert not isinstance(plain.embed.w.get_value(), QArray)  # without _a8 the head stays float
  assert speculative_sweep.draft_bits('int4_g128_a8') == 4
  assert speculative_sweep.draft_bits('int4_g128_a8+head64') is None
  prompt = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 6)), jnp.int32)
  want = greedy_generate(target, prompt, 8)
  got = speculative_generate(target, draft, prompt, 8, gamma=3)
  got = got[0] if isinstance(got, tuple) else got
  np.testing.assert_array_equal(np.asarray(got)[:, :want.shape[1]], np.asarray(want))
  with pytest.raises(ValueError, match='_a8'):
    speculative_sweep.make_draft(target, 'int4_a9')
