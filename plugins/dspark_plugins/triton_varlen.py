"""`DSparkVarlenAttention` as a Triton kernel (see `dspark_plugins.contract`), callable from torch.

One program per (token, KV head, split): it loads the token's `group` query heads of that KV head
together (GQA: the cache rows are read once for the whole group), streams its own slot's cache prefix
in blocks with an online softmax, and, in split 0, the new tokens of its slot (interleaving allowed:
the peers are found by their slot markers). Long contexts are split flash-decoding style across
programs and the partial (max, sum, accumulator) triples are merged afterwards. The matrix products
take the inputs' precision (fp16/bf16 on tensor cores, exact float32 for float32 inputs); scores,
softmax and accumulation are float32 for every input precision.

On a machine without a GPU, `TRITON_INTERPRET=1` runs the same kernel on CPU tensors (the tests do).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

NEG = -1.0e30  # masked score: finite, so an all-masked block cannot make NaNs
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter's numpy dot has no bfloat16


@triton.jit
def _online_block(q, k, v, valid, m_i, l_i, acc, scale, UPCAST: tl.constexpr):
    """Fold one block of keys k/v [N, D] (mask `valid` [N]) into the running softmax of q [G, D].
    The dots take the inputs' precision (exact IEEE for float32) and accumulate in float32."""
    if UPCAST:
        q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [G, N]
    scores = tl.where(valid[None, :], scores, NEG)
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.where(valid[None, :], tl.exp(scores - m_new[:, None]), 0.0)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _varlen_kernel(
    Q, K_NEW, V_NEW, K_CACHE, V_CACHE, SLOT, POS, CACHE_LEN, M_OUT, L_OUT, ACC_OUT,
    tokens, scale,
    sq_t, sq_h, skn_t, skn_h, sc_s, sc_h, sc_l, sm_t, sm_h, sa_t, sa_h, sa_s,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, DIM: tl.constexpr, DIM_P2: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, BIDIRECTIONAL: tl.constexpr, UPCAST: tl.constexpr,
):
    t = tl.program_id(0)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(SLOT + t)
    pos = tl.load(POS + t)
    length = tl.load(CACHE_LEN + slot)

    heads = tl.arange(0, GROUP_P2)
    dims = tl.arange(0, DIM_P2)
    head_ok = heads < GROUP
    dim_ok = dims < DIM
    q = tl.load(Q + t * sq_t + (kv * GROUP + heads)[:, None] * sq_h + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    m_i = tl.full([GROUP_P2], NEG, tl.float32)
    l_i = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, DIM_P2], tl.float32)

    # this split's share of the slot's committed cache
    chunk = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    stop = tl.minimum(start + chunk, length)
    cache = K_CACHE + slot * sc_s + kv * sc_h
    values = V_CACHE + slot * sc_s + kv * sc_h
    for first in range(start, stop, BLOCK_N):
        rows = first + tl.arange(0, BLOCK_N)
        valid = rows < stop
        mask = valid[:, None] & dim_ok[None, :]
        k = tl.load(cache + rows[:, None] * sc_l + dims[None, :], mask=mask, other=0.0)
        v = tl.load(values + rows[:, None] * sc_l + dims[None, :], mask=mask, other=0.0)
        m_i, l_i, acc = _online_block(q, k, v, valid, m_i, l_i, acc, scale, UPCAST)

    # split 0 also reads the new tokens of the same slot (causal by position unless BIDIRECTIONAL)
    new_stop = tl.where(split == 0, tokens, 0)
    for first in range(0, new_stop, BLOCK_N):
        peers = first + tl.arange(0, BLOCK_N)
        inside = peers < tokens
        peer_slot = tl.load(SLOT + peers, mask=inside, other=-1)
        valid = inside & (peer_slot == slot)
        if not BIDIRECTIONAL:
            peer_pos = tl.load(POS + peers, mask=inside, other=0)
            valid = valid & (peer_pos <= pos)
        mask = valid[:, None] & dim_ok[None, :]
        offsets = peers[:, None] * skn_t + kv * skn_h + dims[None, :]
        k = tl.load(K_NEW + offsets, mask=mask, other=0.0)
        v = tl.load(V_NEW + offsets, mask=mask, other=0.0)
        m_i, l_i, acc = _online_block(q, k, v, valid, m_i, l_i, acc, scale, UPCAST)

    out_heads = kv * GROUP + heads
    tl.store(M_OUT + t * sm_t + out_heads * sm_h + split, m_i, mask=head_ok)
    tl.store(L_OUT + t * sm_t + out_heads * sm_h + split, l_i, mask=head_ok)
    tl.store(ACC_OUT + t * sa_t + out_heads[:, None] * sa_h + split * sa_s + dims[None, :], acc,
             mask=head_ok[:, None] & dim_ok[None, :])


def default_splits(tokens: int, kv_heads: int, max_context: int, programs: int = 264) -> int:
    """Split long contexts only while there are too few (token, head) programs to fill the GPU
    (264 = 2 waves on a 132-SM H100/H200)."""
    if tokens * kv_heads >= programs:
        return 1
    return max(1, min(16, math.ceil(max_context / 1024), math.ceil(programs / (tokens * kv_heads))))


def varlen_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor, cache_len: torch.Tensor,
                     bidirectional: bool = False, scale: float | None = None, splits: int | None = None,
                     block_n: int = 64) -> torch.Tensor:
    """The op on torch tensors (shapes as in the contract); returns out [T, Hq, D] in q's dtype."""
    tokens, q_heads, dim = q.shape
    kv_heads = k_new.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} KV heads")
    group = q_heads // kv_heads
    splits = splits or default_splits(tokens, kv_heads, k_cache.shape[2])
    q, k_new, v_new = q.contiguous(), k_new.contiguous(), v_new.contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    if k_new.stride() != v_new.stride() or k_cache.stride() != v_cache.stride():
        raise ValueError("keys and values must have the same layout")
    slot, pos, cache_len = (x.to(torch.int64).contiguous() for x in (slot, pos, cache_len))
    m = torch.empty(tokens, q_heads, splits, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    acc = torch.empty(tokens, q_heads, splits, dim, dtype=torch.float32, device=q.device)
    if tokens:
        _varlen_kernel[(tokens, kv_heads, splits)](
            q,
            k_new,
            v_new,
            k_cache,
            v_cache,
            slot,
            pos,
            cache_len,
            m,
            l_sum,
            acc,
            tokens,
            1.0 / math.sqrt(dim) if scale is None else scale,
            q.stride(0),
            q.stride(1),
            k_new.stride(0),
            k_new.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            m.stride(0),
            m.stride(1),
            acc.stride(0),
            acc.stride(1),
            acc.stride(2),
            GROUP=group,
            GROUP_P2=max(16, triton.next_power_of_2(group)),
            DIM=dim,
            DIM_P2=max(16, triton.next_power_of_2(dim)),
            BLOCK_N=block_n,
            SPLITS=splits,
            BIDIRECTIONAL=bool(bidirectional),
            UPCAST=INTERPRETING and q.dtype == torch.bfloat16,
        )
    return merge_splits(m, l_sum, acc).to(q.dtype)


def merge_splits(m: torch.Tensor, l_sum: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Combine per-split (max [T, H, P], sum [T, H, P], accumulator [T, H, P, D]) into out [T, H, D]."""
    top = m.max(-1, keepdim=True).values
    weight = torch.exp(m - top)
    return (acc * weight[..., None]).sum(2) / (l_sum * weight).sum(-1, keepdim=True)
