"""qjax.data: the vendored corpora are the upstream files, byte for byte, and are named."""

import hashlib
import re

import pytest

from qjax import data


def _readme_hashes() -> dict:
  """{name: sha256} from the table in the corpora README (the provenance record)."""
  readme = (data.corpus_path('tinyshakespeare').parents[1] / 'README.md').read_text()
  rows = re.findall(r'^\| `(\w+)` \| [^|]+ \| (\d+) \| ([0-9a-f]{64}) \|', readme, re.M)
  return {name: (int(size), sha) for name, size, sha in rows}


def test_names():
  assert data.names() == ('tinyshakespeare', 'wikitext2_valid')


@pytest.mark.parametrize('name', ['tinyshakespeare', 'wikitext2_valid'])
def test_file_matches_its_recorded_sha256_and_size(name):
  raw = data.corpus_path(name).read_bytes()
  size, sha = _readme_hashes()[name]
  assert hashlib.sha256(raw).hexdigest() == sha == data.SHA256[name]
  assert len(raw) == size


def test_readme_lists_every_corpus_and_its_licence():
  assert set(_readme_hashes()) == set(data.names())
  readme = (data.corpus_path('wikitext2_valid').parents[1] / 'README.md').read_text()
  assert 'CC BY-SA 3.0' in readme and 'public domain' in readme


def test_corpus_text():
  ts = data.corpus('tinyshakespeare')
  assert ts.startswith('First Citizen:') and ts.count('\n') == 40000
  wt = data.corpus('wikitext2_valid')
  assert wt.count('\n') == 3760 and wt.count('<unk>') == 11718


def test_unknown_name_lists_the_known_ones():
  with pytest.raises(ValueError, match=r"unknown corpus 'wikitext103'.*'tinyshakespeare', "
                                       r"'wikitext2_valid'"):
    data.corpus('wikitext103')
