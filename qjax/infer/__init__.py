"""Inference: sampling, speculative decoding, and the serving engine (paged cache, batching).

    from qjax.infer import SamplingParams, SamplingBatch, sample, processed_logits
    from qjax.infer import Engine, EngineConfig, SpeculativeEngine

The runtime only. Within qjax it imports `qjax.target`, `qjax.core`, `qjax.nn`, `qjax.kernels`
and `qjax.sharding` (the import layers: README.md; tests/test_layers.py holds both to the code).
Request traces, workloads, serving comparisons and plots, draft training and the speculative
sweep are harnesses in `qjax.pipeline` (`trace`, `workload`, `serving`, `draft`,
`speculative_sweep`).
"""

# --- sampling and speculative decoding (qjax/infer/sampling.py, speculative.py) ---
from qjax.infer.sampling import (SamplingBatch, SamplingParams, as_batch, finish_reason,
                                 mark_seen, processed_logits, row_keys, sample, sample_from,
                                 sample_generate, seen_mask, trim_stop_string,
                                 truncate_at_stop)
from qjax.infer.speculative import (SpecStats, check_compatible, layer_skip_draft,
                                    speculative_generate)
from qjax.infer.speculative_core import acceptance_prob, expected_tokens_per_pass, verify
# --- end sampling and speculative decoding ---

# --- engine: blockwise attention, paged KV cache, scheduler, prefix cache (blockwise.py,
# paged.py, page_host.py, scheduler.py, prefix_cache.py, engine_*.py, spec_engine.py) ---
from qjax.infer.blockwise import (attention_temp_bytes, bucket_perplexity, forward_temp_bytes,
                                  token_nll, with_attention_impl)
from qjax.infer.paged import (POOL_AXES, PagedKVCache, init_paged_cache, ring_pages_needed,
                              shard_pools, with_step)
from qjax.infer.page_host import PageAllocator, check_step, read_pages, write_pages
from qjax.infer.paged import forward as paged_forward
from qjax.infer.prefix_cache import PrefixCache, block_hashes
from qjax.infer.engine_config import PREEMPTION_MODES
from qjax.infer.engine_state import SequenceState, StepPlan
from qjax.infer.scheduler import Scheduler
from qjax.infer.engine import Engine, EngineConfig, EngineStats
from qjax.infer.engine_requests import GenerationError
from qjax.infer.spec_engine import SpeculativeEngine
# --- end engine ---
