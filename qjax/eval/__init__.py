"""Evaluation: perplexity, logit comparisons, greedy agreement, results tables and plots."""

from qjax.eval.metrics import (greedy_agreement, kl_divergence, logit_diff, logits, perplexity,
                               unigram_perplexity)
from qjax.eval.report import markdown_table, plot_ppl_vs_bytes

__all__ = ['greedy_agreement', 'kl_divergence', 'logit_diff', 'logits', 'markdown_table',
           'perplexity', 'plot_ppl_vs_bytes', 'unigram_perplexity']
