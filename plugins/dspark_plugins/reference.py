"""Numpy reference of `DSparkVarlenAttention` (see `dspark_plugins.contract`), written for clarity."""

from __future__ import annotations

import numpy as np


def varlen_attention(q, k_new, v_new, k_cache, v_cache, slot, pos, cache_len, bidirectional: bool = False,
                     scale: float | None = None) -> np.ndarray:
    """Attention of each new token over its own slot's cache prefix and its slot's new tokens. Float64 inside."""
    tokens, q_heads, dim = q.shape
    group = q_heads // k_new.shape[1]
    scale = 1.0 / np.sqrt(dim) if scale is None else scale
    out = np.zeros((tokens, q_heads, dim), dtype=np.float64)
    for t in range(tokens):
        s, length = slot[t], cache_len[slot[t]]
        peers = np.flatnonzero((slot == s) & (True if bidirectional else pos <= pos[t]))
        for h in range(q_heads):
            kv = h // group
            keys = np.concatenate([k_cache[s, kv, :length], k_new[peers, kv]]).astype(np.float64)
            values = np.concatenate([v_cache[s, kv, :length], v_new[peers, kv]]).astype(np.float64)
            scores = keys @ q[t, h].astype(np.float64) * scale
            weights = np.exp(scores - scores.max())
            out[t, h] = weights @ values / weights.sum()
    return out.astype(q.dtype)
