"""GPU check of the varlen-verification Triton kernel: error against references and time against two
baselines on Qwen3-8B-shaped attention (GQA 32:8, head_dim 128), printed as a table.

    python scripts/gpu_check.py [--dtype bfloat16] [--repeats 20]

Baselines: torch's scaled_dot_product_attention over a dense [T, all cached + new keys] mask (what a
framework without a varlen kernel does) and a per-request loop of SDPA calls. Bandwidth is the KV bytes
the kernel must read (each slot's cached prefix once per KV head) over its median time. Ends in about
a minute on one H100/H200.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from dspark_plugins.reference import varlen_attention as numpy_reference
from dspark_plugins.triton_varlen import varlen_attention

Q_HEADS, KV_HEADS, DIM = 32, 8, 128
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 8.64e11, "RTX 4090": 1.0e12}


def ragged_batch(contexts: list[int], new: list[int], dtype: torch.dtype, capacity: int, seed: int = 0):
    """Requests with `contexts[i]` cached tokens and `new[i]` new ones, their tokens interleaved."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    slots = len(contexts)
    normal = lambda *shape: torch.randn(*shape, generator=gen, device="cuda").to(dtype)  # noqa: E731
    slot = torch.cat([torch.full((n,), s) for s, n in enumerate(new)])
    slot = slot[torch.randperm(len(slot))].cuda()
    cache_len = torch.tensor(contexts, device="cuda")
    pos = torch.empty_like(slot)
    for s in range(slots):
        mine = (slot == s).nonzero().flatten()
        pos[mine] = cache_len[s] + torch.arange(len(mine), device="cuda")
    tokens = len(slot)
    return (normal(tokens, Q_HEADS, DIM), normal(tokens, KV_HEADS, DIM), normal(tokens, KV_HEADS, DIM),
            normal(slots, KV_HEADS, capacity, DIM), normal(slots, KV_HEADS, capacity, DIM), slot, pos, cache_len)


def per_request(q, k_new, v_new, k_cache, v_cache, slot, pos, cache_len, compute=None):
    """A loop over requests, one SDPA call each (causal over the new tokens, full over the cache)."""
    out = torch.empty_like(q)
    group = Q_HEADS // KV_HEADS
    for s in range(k_cache.shape[0]):
        mine = (slot == s).nonzero().flatten()
        if len(mine) == 0:
            continue
        mine = mine[pos[mine].argsort()]
        length = int(cache_len[s])
        keys = torch.cat([k_cache[s, :, :length], k_new[mine].transpose(0, 1)], 1).repeat_interleave(group, 0)
        values = torch.cat([v_cache[s, :, :length], v_new[mine].transpose(0, 1)], 1).repeat_interleave(group, 0)
        n = len(mine)
        mask = torch.ones(n, length + n, dtype=torch.bool, device=q.device)
        mask[:, length:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        query = q[mine].transpose(0, 1)
        if compute is not None:
            query, keys, values = query.to(compute), keys.to(compute), values.to(compute)
        out[mine] = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask).transpose(0, 1).to(q.dtype)
    return out


def dense_masked(q, k_new, v_new, k_cache, v_cache, slot, pos, cache_len):
    """One SDPA call of every token over every slot's cache and every new token, with a dense mask."""
    slots, _, capacity, _ = k_cache.shape
    group = Q_HEADS // KV_HEADS
    keys = torch.cat([k_cache.transpose(0, 1).reshape(KV_HEADS, -1, DIM), k_new.transpose(0, 1)], 1).repeat_interleave(
        group, 0
    )
    values = torch.cat(
        [v_cache.transpose(0, 1).reshape(KV_HEADS, -1, DIM), v_new.transpose(0, 1)], 1
    ).repeat_interleave(group, 0)
    row = torch.arange(capacity, device=q.device)
    cached = (torch.arange(slots, device=q.device)[None, :, None] == slot[:, None, None]) & (
        row[None, None] < cache_len[slot][:, None, None]
    )
    new = (slot[:, None] == slot[None, :]) & (pos[None, :] <= pos[:, None])
    mask = torch.cat([cached.reshape(len(slot), -1), new], 1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask).transpose(0, 1)


def median_ms(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def peak_bandwidth() -> float | None:
    name = torch.cuda.get_device_name()
    return next((value for key, value in PEAK_BANDWIDTH.items() if key in name), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"device: {torch.cuda.get_device_name()}, dtype {args.dtype}, GQA {Q_HEADS}:{KV_HEADS}, head_dim {DIM}")

    small = ragged_batch([0, 37, 120], [17, 4, 8], torch.float32, capacity=160)
    numpy_error = np.abs(
        varlen_attention(*small).cpu().numpy() - numpy_reference(*(t.cpu().numpy() for t in small))
    ).max()
    print(f"fp32 kernel vs numpy reference (3 slots, a 17-token prefill chunk): max |error| {numpy_error:.2e}")

    cases = [
        ("decode 8 req x 1 tok, 8k ctx", [8192] * 8, [1] * 8),
        ("verify 8 req x 8 tok, 8k ctx", [8192] * 8, [8] * 8),
        ("verify 32 req x 4 tok, 2k ctx", [2048] * 32, [4] * 32),
        (
            "mixed: verify 1-8 + 256-tok prefill",
            [8000, 4000, 1000, 300, 0, 6000, 7000, 2500],
            [1, 8, 3, 5, 256, 2, 7, 4],
        ),
    ]
    columns = (("case", 38), ("T", 4), ("max err", 8), ("kernel ms", 9), ("per-req ms", 10), ("dense ms", 9),
               ("GB/s", 7), ("% peak", 6))
    header = " ".join(f"{name:{'' if name == 'case' else '>'}{width}s}" for name, width in columns)
    print(header)
    print("-" * len(header))
    peak = peak_bandwidth()
    for name, contexts, new in cases:
        batch = ragged_batch(contexts, new, dtype, capacity=max(contexts) + 256, seed=len(name))
        out = varlen_attention(*batch)
        expected = per_request(*batch, compute=torch.float32)
        error = (out.float() - expected.float()).abs().max().item()
        kernel = median_ms(lambda: varlen_attention(*batch), args.repeats)
        loop = median_ms(lambda: per_request(*batch), args.repeats)
        try:
            dense = f"{median_ms(lambda: dense_masked(*batch), args.repeats):9.3f}"
        except torch.OutOfMemoryError:
            dense = f"{'OOM':>9s}"
        kv_bytes = 2 * KV_HEADS * DIM * batch[3].element_size() * (sum(contexts) + sum(new))
        bandwidth = kv_bytes / (kernel / 1e3)
        share = f"{100 * bandwidth / peak:5.1f}%" if peak else "   n/a"
        numbers = f"{len(batch[0]):4d} {error:8.1e} {kernel:9.3f} {loop:10.3f} {dense} {bandwidth / 1e9:7.0f} {share}"
        print(f"{name:38s} {numbers}")


if __name__ == "__main__":
    main()
