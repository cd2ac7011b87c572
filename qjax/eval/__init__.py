"""Evaluation: perplexity, logit comparisons, greedy agreement, results tables and plots."""

from qjax.eval.metrics import (greedy_agreement, kl_divergence, logit_diff, logits, perplexity,
                               unigram_perplexity)
from qjax.eval.report import markdown_table, plot_ppl_vs_bytes
from qjax.eval._validation_report import compare_markdown
from qjax.eval.validation import validate
from qjax.eval.sweep import (append_result, check_base, read_results, repair_tail,
                             require_success, run_sweep)

__all__ = ['append_result', 'check_base', 'read_results', 'repair_tail', 'require_success',
           'run_sweep', 'greedy_agreement', 'kl_divergence', 'logit_diff', 'logits',
           'markdown_table', 'perplexity', 'plot_ppl_vs_bytes', 'unigram_perplexity', 'validate',
           'compare_markdown']
# Submodules: qjax.eval.memory (planner), qjax.eval.process (this process's RSS and map
# table), qjax.eval.sensitivity (sensitivity, fallback, mixed precision), qjax.eval.tasks
# (offline tasks), qjax.eval.validation (the report).
