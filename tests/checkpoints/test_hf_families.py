"""Every HF family `load_hf` reads, against HF transformers itself (the reference extra).

For each tiny random checkpoint (`hf_tiny_families.SPECS`, saved by `save_pretrained`): qjax's
float32 logits on two prompts within 1e-4 of the logits' standard deviation of HF's, and 16
greedy tokens (qjax through its KV cache, HF by full forwards) identical. Runs in
`make test-reference`; without torch and transformers it is skipped.
"""

import pytest

pytest.importorskip('torch', reason='the HF reference needs the reference extra (torch)')
pytest.importorskip('transformers', reason='the HF reference needs the reference extra '
                    '(transformers)')

import hf_tiny_families as fam  # noqa: E402


@pytest.mark.parametrize('family', list(fam.SPECS))
def test_family_matches_hf_transformers(family, tmp_path):
  r = fam.compare(family, tmp_path / family)
  assert r['logits_std'] > 0.1  # the comparison is not of near-constant logits
  assert r['rel_diff'] <= 1e-4, r
  assert r['greedy_identical'], r


def test_the_tiny_models_exercise_their_family_options(tmp_path):
  import json  # pylint: disable=g-import-not-at-top
  cfgs = {}
  for family in ('llama', 'llama3_rope', 'qwen2_yarn', 'gemma2', 'gemma3', 'mistral'):
    fam.build(family, tmp_path / family)
    from qjax.checkpoints import load_hf  # pylint: disable=g-import-not-at-top
    cfgs[family] = load_hf(tmp_path / family)[1]
  assert (tmp_path / 'llama' / 'model.safetensors.index.json').is_file()
  assert len(cfgs['llama']['files']) > 1
  rope = cfgs['llama3_rope']['config'].rope_scaling
  assert rope.kind == 'llama3' and rope.original_max_len < fam.PROMPT_LEN
  assert cfgs['qwen2_yarn']['config'].rope_scaling.attention_factor > 1.0
  g2 = cfgs['gemma2']['config']
  assert g2.global_every == 2 and g2.sliding_window < fam.PROMPT_LEN
  assert g2.final_logit_softcap == 3.0 and g2.attn_logit_softcap == 2.0
  g3 = cfgs['gemma3']
  assert g3['model_type'] == 'gemma3_text' and g3['config'].global_every == 3
  assert json.loads((tmp_path / 'gemma3' / 'config.json').read_text())['model_type'] == 'gemma3'
  assert cfgs['mistral']['source_dtypes'] == ['bfloat16']
