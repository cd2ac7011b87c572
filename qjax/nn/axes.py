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
KV_CACHE_AXES = (BATCH, CACHE_LENGTH, KV_HEADS, HEAD_DIM)  # k_BSKH, v_BSKH
