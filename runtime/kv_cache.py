"""Preallocated key/value caches and the slots that requests borrow.

One cache per graph (target, drafter): per layer K and V of shape [S, Hkv, Lmax, D] (BNSH), allocated
once. A step's new K/V rows are written at (slot, pos); what a slot has committed is its length, so
rejected draft rows need no rollback: they lie beyond the length and are overwritten later.
"""

from __future__ import annotations

import numpy as np


class KVCache:
    def __init__(self, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype=np.float32):
        shape = (slots, kv_heads, max_len, head_dim)
        self.keys = [np.zeros(shape, dtype) for _ in range(layers)]
        self.values = [np.zeros(shape, dtype) for _ in range(layers)]
        self.max_len = max_len

    def feeds(self) -> dict[str, np.ndarray]:
        """The cache as graph inputs `past_key_i` / `past_value_i` (no copies)."""
        feeds = {}
        for layer, (keys, values) in enumerate(zip(self.keys, self.values)):
            feeds[f"past_key_{layer}"], feeds[f"past_value_{layer}"] = keys, values
        return feeds

    def write(self, slot: np.ndarray, pos: np.ndarray, outputs: dict[str, np.ndarray]) -> None:
        """Store the graph's `new_key_i` / `new_value_i` rows [T, Hkv, D] at (slot[t], pos[t])."""
        for layer, (keys, values) in enumerate(zip(self.keys, self.values)):
            keys[slot, :, pos] = outputs[f"new_key_{layer}"]
            values[slot, :, pos] = outputs[f"new_value_{layer}"]


class SlotPool:
    """Free cache slots; a request holds one from admission until it finishes or is cancelled."""

    def __init__(self, slots: int):
        self.free = list(range(slots - 1, -1, -1))
        self.total = slots

    def acquire(self) -> int | None:
        return self.free.pop() if self.free else None

    def release(self, slot: int) -> None:
        if slot in self.free:
            raise RuntimeError(f"slot {slot} released twice")
        self.free.append(slot)
