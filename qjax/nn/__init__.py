"""Flax NNX transformer layers, the KV cache, and quantization policies (rules -> layers).

    from qjax.nn import TransformerConfig, Transformer, init_cache
    model = Transformer(TransformerConfig.tiny(), rngs=nnx.Rngs(0))
    logits_BTV = model(tokens_BT)                              # full causal forward
    logits_BTV, cache = model(prompt_BT, cache=init_cache(cfg, B, S))   # prefill, then decode
    # model(tokens_BT) == model.logits(model.run_layers(model.embed_tokens(tokens_BT), pos_BT)[0])
    qmodel, report = quantize_model(model, QuantPolicy((QuantRule('.*', int_format(8)),)))
"""

__all__ = [
    "Attention", "DecoderLayer", "Einsum", "EinsumQuant", "Embed", "KVCache", "LayerReport", "MLP",
    "QWeight", "QuantPolicy", "QuantReport", "QuantRule", "RMSNorm", "Transformer",
    "TransformerConfig",
    "apply_fake_quant", "apply_rope", "attend", "attend_blockwise", "attention_mask",
    "LoopState", "check_token_ids", "decode_loop", "decode_step", "decode_steps",
    "einsum_layers", "greedy_generate",
    "greedy_step",
    "init_cache", "kv_format", "layer_forms", "layer_paths", "logits_step", "online_attend",
    "model_report",
    "num_params", "param_count", "quantize_model", "relayout_model", "resolve_format",
    "set_kv_format", "weight_bytes", "with_kv_format",
]

from qjax.nn.attention import (Attention, kv_format, layer_forms, set_kv_format,
                               with_kv_format)
from qjax.nn.attention_core import attend, attend_blockwise, attention_mask, online_attend
from qjax.nn.config import TransformerConfig, num_params
from qjax.nn.decode_core import LoopState
from qjax.nn.generate import (decode_loop, decode_step, decode_steps,
                              greedy_generate, greedy_step, logits_step)
from qjax.nn.kvcache import KVCache, init_cache
from qjax.nn.einsum_quant import EinsumQuant
from qjax.nn.layers import Einsum, Embed, QWeight, RMSNorm
from qjax.nn.policy import (QuantPolicy, QuantRule, apply_fake_quant, quantize_model,
                            relayout_model, resolve_format)
from qjax.nn.report import (LayerReport, QuantReport, einsum_layers, layer_paths, model_report,
                            param_count, weight_bytes)
from qjax.nn.rope import apply_rope
from qjax.nn.transformer import MLP, DecoderLayer, Transformer, check_token_ids
