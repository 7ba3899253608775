"""The `DSparkVarlenAttention` op: its contract, in one place.

One op serves target verification, chunked prefill and the drafter's context attention. All
requests' new tokens are flattened into one sequence of T tokens; markers tell each token's request
(cache slot) and absolute position.

Inputs
    q          [T, Hq, D]          queries of the new tokens (RoPE applied)
    k_new      [T, Hkv, D]         keys of the new tokens (RoPE applied)
    v_new      [T, Hkv, D]         values of the new tokens
    k_cache    [S, Hkv, Lmax, D]   committed keys per slot (BNSH)
    v_cache    [S, Hkv, Lmax, D]   committed values per slot
    slot       [T] int64           cache slot of each token's request (a request's tokens may be interleaved)
    pos        [T] int64           absolute position of each token
    cache_len  [S] int64           committed length per slot
Attributes
    bidirectional int (0/1)        0: causal among the new tokens of a slot; 1: all see each other (drafter block)
    scale      float               score scale, default 1/sqrt(D)
Output
    out        [T, Hq, D]

Rule: token t attends to k_cache[slot(t), :, 0:cache_len(slot(t))] and to the new tokens t' with
slot(t') = slot(t) and (bidirectional or pos(t') <= pos(t)). Query head h reads KV head h // (Hq / Hkv).
The op does not write the cache: the runtime commits accepted K/V at (slot, pos).
"""

from __future__ import annotations

DOMAIN = "dspark"
OP_TYPE = "DSparkVarlenAttention"
PLUGIN_NAMESPACE = "dspark"
PLUGIN_VERSION = "1"
INPUTS = ("q", "k_new", "v_new", "k_cache", "v_cache", "slot", "pos", "cache_len")
OUTPUTS = ("out",)
