"""The two commands of docs/models.md from the command line, on tiny random checkpoints saved
by HF transformers (a Llama with llama3 RoPE scaling and a multimodal Gemma 3, each with a
byte-level BPE tokenizer and a chat template): `experiments.convert` (GPTQ int4), then
`experiments.generate --config.chat=True` and `experiments.serve` on its output. Runs in
`make test-reference`; without torch and transformers it is skipped.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip('torch', reason='HF-saved checkpoints need the reference extra (torch)')
pytest.importorskip('transformers', reason='HF-saved checkpoints need the reference extra '
                    '(transformers)')

import hf_testdata  # noqa: E402
import hf_tiny_families as fam  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 320
SMALL = ['--config.group_size=16', '--config.eval.windows=4', '--config.eval.seq_len=32',
         '--config.eval.batch=2', '--config.eval.prompt_len=8', '--config.eval.greedy_tokens=4',
         '--config.calib.seq_len=32', '--config.calib.num_sequences=8']


def _run(args, env):
  proc = subprocess.run([sys.executable, '-m', *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=600, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout + proc.stderr


@pytest.mark.parametrize('family', ['llama3_rope', 'gemma3'])
def test_convert_then_generate_and_serve_from_the_command_line(family, tmp_path,
                                                               subprocess_xla_flags):
  env = dict(os.environ, XLA_FLAGS=subprocess_xla_flags, JAX_PLATFORMS='cpu')
  source, out = tmp_path / 'hf', tmp_path / 'out'
  fam.build(family, source, vocab_size=VOCAB)
  hf_testdata.write_tokenizer(source, VOCAB)
  log = _run(['experiments.convert', '--config=configs/convert.py', f'--config.source={source}',
              '--config.method=gptq', '--config.bits=4', f'--config.out={out}', *SMALL], env)
  assert 'gptq-int4-g16: perplexity' in log and (out / 'conversion_record.json').is_file()
  assert (out / 'tokenizer.json').is_file() and (out / 'tokenizer_config.json').is_file()
  log = _run(['experiments.generate', f'--config.checkpoint={out}', '--config.chat=True',
              '--config.temperature=0', '--config.max_tokens=4', '--prompt=Hello'], env)
  assert f'loaded {out}: gptq' in log and 'tokens max' in log
  log = _run(['experiments.serve', f'--config.checkpoint={out}', '--config.max_tokens=4'], env)
  assert log.count(' -> ') == 3 and '"requests": 3' in log
