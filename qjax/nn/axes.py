"""Logical axis names: the one place they are defined.

Layers name the logical axes of every parameter with these constants; a later rules table
per layout maps them to mesh axes (e.g. `('embed', None), ('mlp', 'model')`). Keep the set
small: two tensors that may be sharded differently need different names, nothing else does.

Dimension glossary (einsum letters, variable suffixes): B batch, T query length, S key/value
length, D model, F feed-forward, N query heads, K kv heads, G query heads per kv head,
H head dim, V vocab, L layers.
"""

EMBED = 'embed'          # D
VOCAB = 'vocab'          # V
Q_HEADS = 'q_heads'      # N
KV_HEADS = 'kv_heads'    # K
HEAD_DIM = 'head_dim'    # H
MLP = 'mlp'              # F

# Activations and caches (not parameters), named here so a layout can shard them too.
BATCH = 'batch'          # B
LENGTH = 'length'        # T
CACHE_LENGTH = 'cache_length'  # S
# An activation's D, F or heads may be sharded differently from the weight's (2D
# weight-stationary: weights E_x F_yz, activations between layers E_xyz), so they are named
# apart from the weight axes.
ACT_EMBED = 'act_embed'        # D of activations (the residual stream, projection outputs)
ACT_MLP = 'act_mlp'            # F of the MLP hidden activations
ACT_HEADS = 'act_heads'        # N of queries and attention outputs
ACT_KV_HEADS = 'act_kv_heads'  # K of keys/values, and of the KV cache
ACT_VOCAB = 'act_vocab'        # V of the logits
CACHE_BATCH = 'cache_batch'    # B inside attention and of the KV cache (multiquery
                               # batch-sharded attention splits it, the residual's B is not)

# Logical axes of activations by einsum letter (`shard_hooks.constrain(x, 'BTD')`).
ACT_AXES = {'B': BATCH, 'T': LENGTH, 'S': CACHE_LENGTH, 'D': ACT_EMBED, 'F': ACT_MLP,
            'N': ACT_HEADS, 'K': ACT_KV_HEADS, 'H': HEAD_DIM, 'V': ACT_VOCAB}

# Weight layouts, by einsum letters of the weight operand.
WEIGHT_AXES = {
    'VD': (VOCAB, EMBED),
    'DV': (EMBED, VOCAB),
    'DNH': (EMBED, Q_HEADS, HEAD_DIM),
    'DKH': (EMBED, KV_HEADS, HEAD_DIM),
    'NHD': (Q_HEADS, HEAD_DIM, EMBED),
    'DF': (EMBED, MLP),
    'FD': (MLP, EMBED),
}
KV_CACHE_AXES = (CACHE_BATCH, CACHE_LENGTH, ACT_KV_HEADS, HEAD_DIM)  # k_BSKH, v_BSKH
