"""Preallocated key/value caches and the slots that requests borrow.

One cache per graph (target, drafter): per layer K and V of shape [S, Hkv, Lmax, D] (BNSH), allocated once
as ONNX Runtime values that stay bound to the graph. A graph that updates its caches in place (its contract's
`present_*` outputs) appends each step's K/V itself; for the others the runtime writes the `new_*` rows at
(slot, pos). What a slot has committed is its length, so rejected draft rows need no rollback: they lie
beyond the length and are overwritten later.
"""

from __future__ import annotations

import numpy as np

from dspark_common.graph_io import GraphIO


class KVCache:
    """The `past_key_i` / `past_value_i` inputs of one graph, allocated from its contract (shape and dtype).

    On the CPU the values share memory with numpy arrays, so the runtime's writes need no copy. On a GPU
    (`device` "cuda") an in-place graph's caches live on the device only; a graph whose rows the runtime writes
    keeps host arrays that are copied to the device after each write (correct, not fast).
    """

    def __init__(self, io: GraphIO, device: str = "cpu"):
        import onnxruntime as ort

        self.in_place, self.device = io.in_place, device
        tensors = [t for t in io.inputs if t.name.startswith("past_")]
        self.arrays: dict[str, np.ndarray] = {}
        if device == "cpu" or not self.in_place:
            self.arrays = {t.name: np.zeros(t.shape, t.numpy_dtype) for t in tensors}
        if device == "cpu":
            self.values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in self.arrays.items()}
        else:
            self.values = {t.name: ort.OrtValue.ortvalue_from_shape_and_type(list(t.shape), t.numpy_dtype, device, 0)
                           for t in tensors}
        self.new_to_past = {"new_" + name.removeprefix("past_"): name for name in self.values}

    def write(self, slot: np.ndarray, pos: np.ndarray, outputs: dict[str, np.ndarray]) -> None:
        """Store the graph's `new_key_i` / `new_value_i` rows [T, Hkv, D] at (slot[t], pos[t])."""
        for new, past in self.new_to_past.items():
            self.arrays[past][slot, :, pos] = outputs[new]
            if self.device != "cpu":
                self.values[past].update_inplace(self.arrays[past])


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
