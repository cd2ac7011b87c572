"""Data shipped with qjax: the vendored text corpora (`corpus`, `corpus_path`, `names`)."""

from qjax.data.corpora import SHA256, corpus, corpus_path, names

__all__ = ['SHA256', 'corpus', 'corpus_path', 'names']
