"""One call's inputs, as the graph I/O contract names them: `TargetBatch` for a target step, `DraftBatch` for a
drafter call. `feeds(io)` reads exactly the inputs the contract lists (caches aside), so a graph kind that
needs an input nobody computes fails at once with its name; the step loop and the profiler both build
their calls here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from dspark_runtime.errors import DSparkError
from dspark_runtime.graph_io import GraphIO

CACHE_PREFIX = "past_"


def _feeds(batch: object, io: GraphIO) -> dict[str, np.ndarray]:
    feeds = {}
    for tensor in io.inputs:
        if tensor.name.startswith(CACHE_PREFIX):
            continue
        value = getattr(batch, tensor.name, None)
        if value is None:
            raise DSparkError(
                f"the {io.graph} graph takes {tensor.name!r}, which {type(batch).__name__} does not provide"
            )
        feeds[tensor.name] = np.asarray(value, dtype=tensor.numpy_dtype)
    return feeds


@dataclass
class TargetBatch:
    """New tokens of several requests, flattened: prefill chunks and verification rows mixed. A request's
    tokens are consecutive positions after its committed ones (pos = cache_len + offset), which the slot
    layout of the ONNX Runtime lowering (`slot_rows` ... `total_length`) relies on."""

    input_ids: np.ndarray  # [T]
    pos: np.ndarray  # [T] absolute positions
    slot: np.ndarray  # [T] cache slot of each token's request
    cache_len: np.ndarray  # [S] committed length per slot
    logit_index: np.ndarray  # [N] tokens whose logits are wanted

    def feeds(self, io: GraphIO) -> dict[str, np.ndarray]:
        return _feeds(self, io)

    @cached_property
    def _counts(self) -> np.ndarray:
        return np.bincount(self.slot, minlength=len(self.cache_len))

    @cached_property
    def token_rows(self) -> np.ndarray:
        """[T, 2]: each token's slot and offset among its slot's new tokens."""
        rows = np.empty((len(self.slot), 2), dtype=np.int64)
        rows[:, 0] = self.slot
        np.subtract(self.pos, self.cache_len[self.slot], out=rows[:, 1])
        return rows

    @cached_property
    def slot_rows(self) -> np.ndarray:
        """[S, M]: the token at each row of the slot-padded layout (padding repeats token 0)."""
        rows = np.zeros((len(self.cache_len), max(int(self._counts.max()), 1)), dtype=np.int64)
        rows[self.token_rows[:, 0], self.token_rows[:, 1]] = np.arange(len(self.slot))
        return rows

    @cached_property
    def seqlens_k(self) -> np.ndarray:
        """Per slot, positions cached after the step, less one (0 for an idle empty slot)."""
        return np.maximum(self.cache_len + self._counts - 1, 0)

    @property
    def query_seqlens(self) -> np.ndarray:
        return self._counts

    @property
    def total_length(self) -> np.ndarray:
        return np.asarray(self.seqlens_k.max() + 1)


@dataclass
class DraftRequest:
    """One request's part of a drafter call."""

    slot: int
    anchor: int  # newest token, at `anchor_pos`
    anchor_pos: int
    context_start: int  # first position whose target features the drafter has not read yet
    features: np.ndarray  # [anchor_pos - context_start, F] those features
    next_tokens: list[int]  # the tokens at context_start + 1 .. anchor_pos (the last is the anchor)
    temperature: float
    noise: np.ndarray  # [γ] uniforms, one per draft


class DraftBatch:
    """The inputs of one drafter call over several requests; a property per input any drafter kind may take."""

    def __init__(self, requests: list[DraftRequest], cache_len: np.ndarray):
        self.requests, self.cache_len = requests, cache_len

    def feeds(self, io: GraphIO) -> dict[str, np.ndarray]:
        return _feeds(self, io)

    @cached_property
    def _rows(self) -> np.ndarray:
        return np.asarray([len(r.features) for r in self.requests])

    @cached_property
    def context_features(self) -> np.ndarray:
        return np.concatenate([r.features for r in self.requests])

    @cached_property
    def context_slot(self) -> np.ndarray:
        return np.repeat([r.slot for r in self.requests], self._rows)

    @cached_property
    def context_pos(self) -> np.ndarray:
        return np.concatenate([np.arange(r.context_start, r.anchor_pos) for r in self.requests])

    @cached_property
    def context_ids(self) -> np.ndarray:
        """EAGLE-3: entry t pairs position t's features with token t + 1."""
        return np.concatenate([r.next_tokens for r in self.requests])

    @cached_property
    def context_last(self) -> np.ndarray:
        """EAGLE-3: each request's newest entry, where its draft starts."""
        return np.cumsum(self._rows) - 1

    @cached_property
    def anchor_ids(self) -> np.ndarray:
        return np.asarray([r.anchor for r in self.requests])

    @cached_property
    def anchor_pos(self) -> np.ndarray:
        return np.asarray([r.anchor_pos for r in self.requests])

    @cached_property
    def request_slot(self) -> np.ndarray:
        return np.asarray([r.slot for r in self.requests])

    @cached_property
    def noise(self) -> np.ndarray:
        return np.stack([r.noise for r in self.requests])

    @cached_property
    def temperature(self) -> np.ndarray:
        return np.asarray([r.temperature for r in self.requests])
