"""Preallocated key/value caches and the slots that requests borrow.

One cache per graph (target, drafter): per layer K and V of shape [S, Hkv, Lmax, D] (BNSH), allocated
once. A step's new K/V rows are written at (slot, pos); what a slot has committed is its length, so
rejected draft rows need no rollback: they lie beyond the length and are overwritten later.
"""

from __future__ import annotations

import numpy as np

from dspark_runtime.graph_io import GraphIO


class KVCache:
    """The `past_key_i` / `past_value_i` inputs of one graph, allocated once from its contract (shape and dtype)."""

    def __init__(self, io: GraphIO):
        self.arrays = {t.name: np.zeros(t.shape, t.numpy_dtype) for t in io.inputs if t.name.startswith("past_")}
        self.new_to_past = {"new_" + name.removeprefix("past_"): name for name in self.arrays}

    def feeds(self) -> dict[str, np.ndarray]:
        """The cache as graph inputs (no copies)."""
        return self.arrays

    def write(self, slot: np.ndarray, pos: np.ndarray, outputs: dict[str, np.ndarray]) -> None:
        """Store the graph's `new_key_i` / `new_value_i` rows [T, Hkv, D] at (slot[t], pos[t])."""
        for new, past in self.new_to_past.items():
            self.arrays[past][slot, :, pos] = outputs[new]


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
