"""The command-line entry points: `--config.*` overrides checked against the config (a
setting it does not have names the flag), plain strings for a tuple of strings, errors that
name the flag to change, and a run from another working directory."""

import os
import subprocess
import sys

import pytest

from configs import engine_tiny
from qjax.pipeline import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_an_unknown_setting_names_the_flag_and_the_closest_ones():
  config = engine_tiny.get_config()
  with pytest.raises(cli.app.UsageError, match=r"serve: --config.workload.num_requets: "
                                               r"cfg.py has no setting 'workload.num_requets'."
                                               r' Did you mean --config.workload.num_requests'):
    cli.check_overrides(['x', '--config.workload.num_requets=3'], config, 'cfg.py', 'serve')
  with pytest.raises(cli.app.UsageError, match=r"no setting 'bogus'.*Its settings are: chat, "
                                               'checkpoint'):
    cli.check_overrides(['x', '--config.bogus=1'], config, 'cfg.py', 'serve')


def test_a_plain_string_is_one_prompt():
  config = engine_tiny.get_config()
  got = cli.check_overrides(['x', '--config.prompts=Hello world', '--config.max_tokens=3',
                             "--config.prompts=('a', 'b')"], config, 'cfg.py', 'serve')
  assert got == ['x', "--config.prompts=('Hello world',)", '--config.max_tokens=3',
                 "--config.prompts=('a', 'b')"]


def _run(args, cwd, env_extra=None, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS='cpu', **(env_extra or {}))
  return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                        timeout=timeout, env=env, check=False)


@pytest.mark.parametrize('script,flag,message', [
    ('convert', '--config.foo=1', "experiments.convert: --config.foo: .*convert.py has no "
                                  "setting 'foo'"),
    ('serve', '--config.bogus=1', "experiments.serve: --config.bogus: .*engine_tiny.py has no "
                                  "setting 'bogus'"),
])
def test_unknown_settings_exit_with_a_usage_error_from_any_directory(tmp_path, script, flag,
                                                                      message):
  import re  # pylint: disable=g-import-not-at-top
  r = _run([os.path.join(ROOT, 'experiments', f'{script}.py'), flag], cwd=tmp_path)
  assert r.returncode == 2 and re.search(message, r.stderr), r.stderr[-2000:]
  assert 'Traceback' not in r.stderr


@pytest.mark.parametrize('args,message', [
    (['experiments.serve', '--config.workload.num_requests=0'],
     r'--config.workload.num_requests=0: the workload needs at least one request'),
    (['experiments.generate', '--prompt='], r"--prompt='' is empty"),
    (['experiments.generate', '--config.model=tiyn', '--prompt=Hi'],
     r"--config.model='tiyn' is not a model this command loads; use one of \('gemma3_270m', "
     r"'tiny'\)"),
])
def test_bad_values_name_the_flag(args, message):
  import re  # pylint: disable=g-import-not-at-top
  r = _run(['-m', *args], cwd=ROOT)
  assert r.returncode == 2 and re.search(message, r.stderr), r.stderr[-2000:]
  # A refusal is its message alone; QJAX_TRACEBACK=1 shows where it was raised.
  assert 'Traceback' not in r.stderr and f'{args[0]}: ValueError: ' in r.stderr, r.stderr
  if args[0] == 'experiments.generate':
    r = _run(['-m', *args], cwd=ROOT, env_extra={'QJAX_TRACEBACK': '1'})
    assert r.returncode != 0 and 'Traceback' in r.stderr, r.stderr[-2000:]


def test_generate_runs_from_another_directory_and_says_what_it_uses(tmp_path,
                                                                    subprocess_xla_flags):
  r = _run([os.path.join(ROOT, 'experiments', 'generate.py'), '--config.model=tiny',
            '--config.weights=float', '--config.max_tokens=2', '--config.engine.max_len=64',
            '--prompt=Hi'], cwd=tmp_path, env_extra={'XLA_FLAGS': subprocess_xla_flags})
  assert r.returncode == 0, r.stderr[-3000:]
  assert ('generating with weights float, KV cache int8-ch012, temperature 0.7, top_p 0.95'
          in r.stderr)


def test_a_prompt_past_the_context_names_the_flag_that_fixes_it():
  # It said 'raise --config.engine.max_len (the model holds 512)' when the context was 512
  # already, where no flag helps.
  cli.check_context(0, 10, 6, 16, 512)
  with pytest.raises(ValueError, match=r'prompt 1 has 10 tokens \+ --config.max_tokens=8 > the '
                                       r'context 16; pass --config.engine.max_len=18 or more '
                                       r'\(the model holds 512\), or lower --config.max_tokens'):
    cli.check_context(1, 10, 8, 16, 512)
  with pytest.raises(ValueError, match=r'> the context 512; the model holds 512 tokens at most: '
                                       r'shorten the prompt, or lower --config.max_tokens'):
    cli.check_context(0, 721, 48, 512, 512)
