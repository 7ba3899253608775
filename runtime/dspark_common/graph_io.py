"""The graph I/O contract: the inputs and outputs of every graph an engine holds, defined once.

The exporter declares its graphs from it, the step loop and the profiler build their feeds from it, the
TensorRT build takes its shape profiles from it, and the runtime refuses a graph that does not match it.
Adding a drafter kind is an entry in `DRAFTER_IO` plus one graph body in the exporter.

Each port has a name (`{layer}` expands per layer), a dtype rule and dimensions. Dtypes: `int64`,
`float32`, or `ACTIVATION` (the graph's activation dtype: the target's is the manifest's `dtype`).
Dimensions are symbols the runtime sets per call (`T` new target tokens, `N` rows that want logits, `M`
the most new tokens of one slot, `C` new drafter context rows, `R` drafted requests, `P` the distribution
width: V, or 0 when an all-greedy call skips distributions) or the graph's own sizes (`S` cache slots, `Lmax`
positions per slot, `Hkv` KV heads, `D` head size, `V` vocabulary, `F` feature width, `G` γ).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from dspark_common.errors import DSparkError

ACTIVATION = "activation"
NUMPY_DTYPES = {"int64": np.dtype(np.int64), "int32": np.dtype(np.int32), "float32": np.dtype(np.float32),
                "float16": np.dtype(np.float16)}
ACTIVATION_DTYPES = ("float32", "float16", "bfloat16")  # bfloat16 graphs are for TensorRT (numpy and ORT's CPU lack it)


@dataclass(frozen=True)
class Port:
    name: str
    dtype: str  # "int64" | "float32" | ACTIVATION
    dims: tuple[str | int, ...]


def _ports(*rows: tuple[str, str, str]) -> tuple[Port, ...]:
    """("name", "dtype", "dim dim ...") rows -> ports."""
    return tuple(
        Port(name, dtype, tuple(int(d) if d.isdigit() else d for d in dims.split())) for name, dtype, dims in rows
    )


CACHE_INPUTS = _ports(
    ("past_key_{layer}", ACTIVATION, "S Hkv Lmax D"), ("past_value_{layer}", ACTIVATION, "S Hkv Lmax D")
)
# target attentions that append to the KV caches in place, in the slot-padded layout: ONNX Runtime's
# GroupQueryAttention ("gqa") and DSpark's CachedAttention ("cached", a row computed alike alone and in a batch)
IN_PLACE_ATTENTION = ("gqa", "cached")
TARGET_IO = (
    _ports(("input_ids", "int64", "T"), ("pos", "int64", "T"), ("slot", "int64", "T"), ("cache_len", "int64", "S"),
           ("logit_index", "int64", "N")) + CACHE_INPUTS,
    _ports(("logits", "float32", "N V"), ("new_key_{layer}", ACTIVATION, "T Hkv D"),
           ("new_value_{layer}", ACTIVATION, "T Hkv D"), ("features", "float32", "T F")),
)
# the ONNX Runtime lowering: its GroupQueryAttention takes the requests as a batch of cache slots, each slot's
# new tokens right-padded to the step's longest (M); the runtime lays the step out (`TargetBatch`): the token at
# each padded row, each token's (slot, offset), and the kernel's lengths. The graph appends each step's K/V to its
# caches in place (past and present share one buffer), so they are outputs of the cache's shape, not token rows.
TARGET_IN_PLACE_IO = (
    _ports(("input_ids", "int64", "T"), ("logit_index", "int64", "N"), ("slot_rows", "int64", "S M"),
           ("token_rows", "int64", "T 2"), ("seqlens_k", "int32", "S"), ("query_seqlens", "int32", "S"),
           ("total_length", "int32", "")) + CACHE_INPUTS,
    _ports(("logits", "float32", "N V"), ("present_key_{layer}", ACTIVATION, "S Hkv Lmax D"),
           ("present_value_{layer}", ACTIVATION, "S Hkv Lmax D"), ("features", "float32", "T F")),
)
_DRAFT_OUTPUTS = _ports(("draft_tokens", "int64", "R G"), ("draft_probs", "float32", "R G P"),
                        ("confidence_logits", "float32", "R G"), ("new_key_{layer}", ACTIVATION, "C Hkv D"),
                        ("new_value_{layer}", ACTIVATION, "C Hkv D"))
_SAMPLING = _ports(("noise", "float32", "R G"), ("temperature", "float32", "R"))
_BLOCK_INPUTS = (
    _ports(
        ("context_features", "float32", "C F"),
        ("context_slot", "int64", "C"),
        ("context_pos", "int64", "C"),
        ("anchor_ids", "int64", "R"),
        ("anchor_pos", "int64", "R"),
        ("request_slot", "int64", "R"),
        ("cache_len", "int64", "S"),
    )
    + CACHE_INPUTS
    + _SAMPLING
)
_EAGLE3_INPUTS = _ports(
    ("context_features", "float32", "C F"), ("context_ids", "int64", "C"), ("context_slot", "int64", "C"),
    ("context_pos", "int64", "C"), ("context_last", "int64", "R"), ("anchor_pos", "int64", "R"),
    ("request_slot", "int64", "R"), ("cache_len", "int64", "S"),
) + CACHE_INPUTS + _SAMPLING
# drafter type -> (inputs, outputs); `confidence_logits` only where the drafter has a confidence head
DRAFTER_IO = {
    "dspark": (_BLOCK_INPUTS, _DRAFT_OUTPUTS),
    "dflash": (_BLOCK_INPUTS, _DRAFT_OUTPUTS),
    "eagle3": (_EAGLE3_INPUTS, _DRAFT_OUTPUTS),
}
DRAFTER_TYPES = tuple(DRAFTER_IO)


@dataclass(frozen=True)
class Tensor:
    """A port resolved for one engine: its name, numpy dtype and shape (ints, or symbols set per call)."""

    name: str
    dtype: str  # "int64" | "float32" | "float16" | "bfloat16"
    shape: tuple[int | str, ...]

    @property
    def numpy_dtype(self) -> np.dtype:
        if self.dtype not in NUMPY_DTYPES:
            raise DSparkError(
                f"{self.name} is {self.dtype}, which this runtime cannot hold (build with --dtype float32 or float16)"
            )
        return NUMPY_DTYPES[self.dtype]


@dataclass(frozen=True)
class GraphIO:
    """The resolved inputs and outputs of one graph, in order."""

    graph: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)

    def input(self, name: str) -> Tensor:
        return next(t for t in self.inputs if t.name == name)

    def cache_names(self, kind: str) -> list[str]:
        """The per-layer ports of one kind (`past_key`, `new_value`, `present_key`, ...), in layer order."""
        return [t.name for t in self.inputs + self.outputs if t.name.rsplit("_", 1)[0] == kind]

    @cached_property
    def fed(self) -> tuple[tuple[str, np.dtype], ...]:
        """The inputs a call feeds (every one but the caches, which stay bound) and their numpy dtypes."""
        return tuple((t.name, t.numpy_dtype) for t in self.inputs if not t.name.startswith("past_"))

    @cached_property
    def in_place(self) -> bool:
        """Whether the graph writes its caches itself (outputs `present_*`), else the runtime commits `new_*` rows."""
        return any(t.name.startswith("present_") for t in self.outputs)


def _resolve(graph: str, ports: tuple[tuple[Port, ...], tuple[Port, ...]], sizes: dict[str, int], layers: int,
             activation: str, skip: set[str]) -> GraphIO:
    def expand(group: tuple[Port, ...]) -> tuple[Tensor, ...]:
        out = []
        for port in group:
            if port.name in skip:
                continue
            dtype = activation if port.dtype == ACTIVATION else port.dtype
            shape = tuple(sizes.get(d, d) for d in port.dims)
            names = [port.name.format(layer=i) for i in range(layers)] if "{layer}" in port.name else [port.name]
            out += [Tensor(name, dtype, shape) for name in names]
        return tuple(out)

    return GraphIO(graph, expand(ports[0]), expand(ports[1]))


def target_io(layers: int, kv_heads: int, head_dim: int, vocab: int, features: int, dtype: str, in_place: bool = False,
              slots: int | str = "S", cache_rows: int | str = "Lmax") -> GraphIO:
    """The target graph's contract; `features` is the feature width (0: no `features` output); `in_place`: the
    graph updates its caches itself."""
    sizes = {"S": slots, "Lmax": cache_rows, "Hkv": kv_heads, "D": head_dim, "V": vocab, "F": features}
    if dtype not in ACTIVATION_DTYPES:
        raise DSparkError(f"unknown activation dtype {dtype!r} (choose from {', '.join(ACTIVATION_DTYPES)})")
    ports = TARGET_IN_PLACE_IO if in_place else TARGET_IO
    return _resolve("target", ports, sizes, layers, dtype, set() if features else {"features"})


def drafter_io(drafter_type: str, layers: int, kv_heads: int, head_dim: int, features: int, gamma: int,
               confidence: bool, slots: int | str = "S", cache_rows: int | str = "Lmax") -> GraphIO:
    """A drafter graph's contract (float32 activations)."""
    if drafter_type not in DRAFTER_IO:
        raise DSparkError(f"unknown drafter type {drafter_type!r} (known: {', '.join(DRAFTER_TYPES)})")
    sizes = {"S": slots, "Lmax": cache_rows, "Hkv": kv_heads, "D": head_dim, "F": features, "G": gamma}
    skip = set() if confidence else {"confidence_logits"}
    return _resolve(f"drafter ({drafter_type})", DRAFTER_IO[drafter_type], sizes, layers, "float32", skip)
