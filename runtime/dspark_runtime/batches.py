"""One call's inputs, as the graph I/O contract names them: `TargetBatch` for a target step, `DraftBatch` for a
drafter call. `feeds(io)` reads exactly the inputs the contract lists (caches aside), so a graph kind that
needs an input nobody computes fails at once with its name; the step loop and the profiler both build
their calls here, and `lay_out` lays a step's requests out in one target batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from dspark_common.errors import DSparkError
from dspark_common.graph_io import GraphIO

if TYPE_CHECKING:
    from dspark_common.engine_dir import Manifest
    from dspark_runtime.sequence import Sequence


def _feeds(batch: object, io: GraphIO) -> dict[str, np.ndarray]:
    feeds = {}
    for name, dtype in io.fed:
        value = getattr(batch, name, None)
        if value is None:
            raise DSparkError(f"the {io.graph} graph takes {name!r}, which {type(batch).__name__} does not provide")
        feeds[name] = np.asarray(value, dtype=dtype)
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

    def cache_rows(self) -> tuple[np.ndarray, np.ndarray]:
        return self.slot, self.pos

    @cached_property
    def _layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(new tokens per slot, [T, 2] each token's slot and offset among its slot's, the slot-padded rows,
        seqlens_k, total_length), at once and in plain Python: the step loop builds this every step, for a few
        tokens, where each numpy call costs more than the work."""
        cache, slots = self.cache_len.tolist(), self.slot.tolist()
        counts, pairs = [0] * len(cache), []
        for slot, pos in zip(slots, self.pos.tolist()):
            pairs.append((slot, pos - cache[slot]))
            counts[slot] += 1
        width = max(max(counts), 1)
        rows = [[0] * width for _ in cache]
        for token, (slot, offset) in enumerate(pairs):
            rows[slot][offset] = token
        seqlens = [length + count - 1 if length + count else 0 for length, count in zip(cache, counts)]
        return (np.array(counts, np.int32), np.array(pairs, np.int64).reshape(-1, 2), np.array(rows, np.int64),
                np.array(seqlens, np.int32), np.array(max(seqlens) + 1, np.int32))

    @property
    def token_rows(self) -> np.ndarray:
        """[T, 2]: each token's slot and offset among its slot's new tokens."""
        return self._layout[1]

    @property
    def slot_rows(self) -> np.ndarray:
        """[S, M]: the token at each row of the slot-padded layout (padding repeats token 0)."""
        return self._layout[2]

    @property
    def seqlens_k(self) -> np.ndarray:
        """Per slot, positions cached after the step, less one (0 for an idle empty slot)."""
        return self._layout[3]

    @property
    def query_seqlens(self) -> np.ndarray:
        return self._layout[0]

    @property
    def total_length(self) -> np.ndarray:
        return self._layout[4]


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

    def cache_rows(self) -> tuple[np.ndarray, np.ndarray]:
        return self.context_slot, self.context_pos

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


@dataclass
class Row:
    """Where one request's tokens sit in the flattened target batch."""

    sequence: Sequence
    start: int  # first token index in the batch
    count: int  # tokens in the batch
    logit_start: int  # first row in the logits output
    logit_count: int
    drafts: int  # drafts verified (decode) or -1 (prefill chunk)


def lay_out(active: list[Sequence], lengths: dict[int, int], manifest: Manifest,
            row_multiple: int = 1) -> tuple[list[Row], TargetBatch]:
    """One step's target batch: every decoding request's anchor and the `lengths[id]` drafts it verifies, then prefill
    chunks of new requests within the token budget and the cache rows; and where each request's tokens sit.

    A step is padded to a multiple of `row_multiple` tokens with copies of its last token at the next positions (no
    row reads them; their cache rows are written again by the next step). With 2 every row runs in a pair: ONNX
    Runtime's attention computes a query alone otherwise than several, and on some CPUs its int4 kernels a lone row,
    alone or last in an odd batch; so a plain step computes exactly as a verification step does and no row depends
    on the others (`Engine.load(exact_greedy=True)`)."""
    ids, slots, positions, logit_index, rows = [], [], [], [], []
    budget = manifest.max_batch_tokens
    decoding = [s for s in active if s.decoding]
    prefilling = [s for s in active if not s.decoding]
    for s in decoding:
        drafts = lengths[s.request_id]
        tokens = [s.anchor] + ([] if drafts == 0 else s.drafts[:drafts].tolist())
        rows.append(Row(s, len(ids), len(tokens), len(logit_index), len(tokens), drafts))
        logit_index += range(len(ids), len(ids) + len(tokens))
        ids += tokens
        slots += [s.slot] * len(tokens)
        positions += range(s.target_len, s.target_len + len(tokens))
    # a slot's new tokens are padded to the step's longest in a cache of cache_rows positions: a chunk may
    # not run past the end of the fullest slot's rows (decoding rows always fit: cache_rows leaves γ + 1)
    longest = manifest.cache_rows - max(s.target_len for s in active) - (row_multiple - 1)  # room for the padding
    for s in prefilling:
        room = min(budget - len(ids), longest)
        if room <= 0 and ids:
            break
        chunk = s.prompt[s.prefilled : s.prefilled + max(room, 1)]
        final = s.prefilled + len(chunk) == len(s.prompt)
        rows.append(Row(s, len(ids), len(chunk), len(logit_index), int(final), -1))
        if final:
            logit_index.append(len(ids) + len(chunk) - 1)
        ids += chunk
        slots += [s.slot] * len(chunk)
        positions += range(s.prefilled, s.prefilled + len(chunk))
    while len(ids) % row_multiple:
        ids.append(ids[-1])
        slots.append(slots[-1])
        positions.append(positions[-1] + 1)
    cache_len = np.zeros(manifest.cache_slots, dtype=np.int64)
    for s in active:
        cache_len[s.slot] = s.target_len
    batch = TargetBatch(np.asarray(ids, dtype=np.int64), np.asarray(positions, dtype=np.int64),
                        np.asarray(slots, dtype=np.int64), cache_len, np.asarray(logit_index, dtype=np.int64))
    return rows, batch
