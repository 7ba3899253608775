"""Weights into a graph: streamed one tensor (or one slice of rows) at a time into an ONNX external-data file, so
that peak build memory stays far below the checkpoint's size; and `Weights.linear` / `Weights.embedding`, the one
place every projection and embedding of every graph is emitted, in the engine's weight format.

Formats: `fp32`, `fp16`, `bf16` store the checkpoint's weights in that precision (the graph's activation dtype);
`int8` and `int4` quantize them block-wise along the input axis (symmetric, one float scale per block of
`block_size` weights, the block's largest-magnitude weight mapped to the most negative code so that every code
is used) for ONNX Runtime's `MatMulNBits` and `GatherBlockQuantized`, whose `accuracy_level` 4 computes in int8
on CPUs. `w8a8` stores int8 weights with one scale per output channel, transposed to [in, out], and quantizes
each activation row to int8 at run time (one scale per row): the products are integer `MatMulInteger`s through
ONNX Runtime's packed QGEMM, whose cost barely grows with the rows, and a row computes the same whatever other
rows share its step. A GGUF file's own quantized matrices (a `carrier`'s) keep their blocks: Q4_0 and Q8_0 in
`MatMulNBits`, K-quants on DSpark's `KQuantMatMul` (`dspark_common.k_quant_rows`), which multiplies as ggml does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np
from onnx import TensorProto

from dspark_export.checkpoint import as_float32
from dspark_export.graphs.ggml_rounding import q8_k_rounding
from dspark_common import int4_rows, k_quant_rows
from dspark_common.engine_checks import INT4_ROWS, WEIGHT_FORMATS
from dspark_common.native import DOMAIN
from dspark_common.errors import ConfigError
from dspark_plugins.builder import GraphBuilder

ONNX_DTYPES = {
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "bfloat16": TensorProto.BFLOAT16,
    "int8": TensorProto.INT8,
    "uint8": TensorProto.UINT8,
    "int64": TensorProto.INT64,
    "int32": TensorProto.INT32,
}
ALIGN = 64
FLOAT_WEIGHTS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # weight format -> its dtype
QUANTIZED_BITS = {"int8": 8, "int4": 4, "w8a8": 8, "w4a8": 4}
PER_CHANNEL = "w8a8"  # the format of per-channel int8 weights and per-row int8 activations
ACTIVATION_ZERO = 128  # a w8a8 activation code is uint8, its zero at 128 (ONNX Runtime's QGEMM takes u8 x s8)
TILES, TILE_SCALES = ".tiles", ".tile_scales"  # w4a8 initializer suffixes
K_QUANT_SUFFIXES = tuple(".k_" + part for part in k_quant_rows.PARTS)  # a GGUF K-quant matrix's operator inputs
CHUNK_ELEMENTS = 1 << 22  # rows are quantized this many weights at a time (16 MB of float32)
Reader = Callable[[str], tuple[np.ndarray, str]]  # tensor name -> (stored array, its dtype; bfloat16 as uint16 bits)


@dataclass(frozen=True)
class Layout:
    """How a quantized matrix is stored: bits per code, weights per block, whether blocks have zero points (else
    MatMulNBits' implicit 2^(bits-1)) and an additive float offset (a K-quant's -dmin·m: its products add the input's
    block sums times the offsets)."""

    bits: int
    block_size: int
    zero_points: bool = False
    offsets: bool = False


@dataclass(frozen=True)
class Carried:
    """A checkpoint's own quantized matrix [n, K] in MatMulNBits' layout: codes [n, K/block, block·bits/8] (4-bit
    codes two to a byte, the even element low), float32 scales [n, K/block], uint8 zero points [n, K/block] (4-bit:
    two to a byte) or None, float32 offsets [n, K/block] or None; w = (code - zero point) · scale + offset."""

    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    layout: Layout
    offsets: np.ndarray | None = None


class Carrier(Protocol):
    """A checkpoint that holds quantized matrices (a GGUF's): what it can hand over as they are."""

    def carried_layout(self, name: str) -> Layout | None: ...

    def carried(self, name: str) -> Carried | None: ...

    def rounds_activations(self, name: str) -> bool: ...

    def ggml_blocks(self, name: str) -> tuple[str, np.ndarray] | None: ...


@dataclass(frozen=True)
class WeightFormat:
    name: str = "fp32"  # one of WEIGHT_FORMATS
    block_size: int = 32  # weights per quantization block (int8, int4); see `dspark-export build --quant-block-size`
    accuracy_level: int = 4  # MatMulNBits: 4 computes in int8 on CPUs, 0 dequantizes to float
    code_max: int = 127  # w8a8: the largest weight code, 63 where the CPU's int8 kernel sums pairs in int16

    def __post_init__(self) -> None:
        if self.name not in WEIGHT_FORMATS:
            raise ConfigError(f"unknown weight format {self.name!r} (choose from {', '.join(WEIGHT_FORMATS)})")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"--quant-block-size must be a power of two, at least 16 (got {self.block_size})")
        if self.code_max not in (63, 127):
            raise ConfigError(f"w8a8 weight codes reach 63 (7 bits) or 127 (8 bits), not {self.code_max}")

    @property
    def bits(self) -> int | None:
        return QUANTIZED_BITS.get(self.name)

    @property
    def per_channel(self) -> bool:
        """Weights with one scale per output channel and activations quantized per row (`w8a8`), not in blocks."""
        return self.name == PER_CHANNEL

    @property
    def int4_rows(self) -> bool:
        """int4 weights in tiles for `ai.dspark`'s `Int4RowsMatMul`, activations quantized per row (`w4a8`)."""
        return self.name == INT4_ROWS

    @property
    def blocked(self) -> bool:
        """Weights quantized in blocks along the input axis for ONNX Runtime's `MatMulNBits` (int8, int4)."""
        return self.bits is not None and not self.per_channel and not self.int4_rows

    def __str__(self) -> str:
        """"int4 weights in blocks of 32", "w8a8 weights (8-bit codes, ...)", "fp32 weights"."""
        if self.int4_rows:
            return ("w4a8 weights (int4 in blocks of 32 with float16 scales, activations quantized per row: DSpark's "
                    "own operators)")
        if self.per_channel:
            return (f"w8a8 weights ({self.code_max.bit_length() + 1}-bit codes per output channel, activations "
                    "quantized per row)")
        return f"{self.name} weights" + (f" in blocks of {self.block_size}" if self.bits else "")


def float_weights(dtype: str) -> WeightFormat:
    """The float weight format of an activation dtype (fp32 for float32, ...)."""
    return WeightFormat(next(name for name, of in FLOAT_WEIGHTS.items() if of == dtype))


def convert(array: np.ndarray, stored: str, dtype: str) -> np.ndarray:
    """A checkpoint tensor (bfloat16 as uint16 bits) in the graph's dtype (bfloat16 again as uint16 bits)."""
    if dtype == stored:
        return np.ascontiguousarray(array)
    wide = as_float32(array, stored)
    if dtype == "float32":
        return wide
    if dtype == "float16":
        return wide.astype(np.float16)
    bits = wide.view(np.uint32)  # round to nearest even
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def quantize_rows(rows: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows [n, K] -> (codes [n, K / block_size, block_size * bits / 8] uint8, scales [n, K / block_size]).

    Symmetric: w ≈ (code - 2^(bits-1)) · scale, where each block's scale maps its largest-magnitude weight
    to -2^(bits-1) exactly. 4-bit codes pack two to a byte, the even element in the low nibble.
    """
    n, k = rows.shape
    blocks = rows.reshape(n, k // block_size, block_size)
    peak = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]
    half = 1 << (bits - 1)
    scales = peak / -half
    scales[scales == 0] = 1.0
    codes = (np.clip(np.rint(blocks / scales[..., None]), -half, half - 1) + half).astype(np.uint8)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes, scales.astype(np.float32)


def quantized_values(rows: np.ndarray, bits: int, block_size: int) -> np.ndarray:
    """float32 rows [n, K] as the graph computes with them after `quantize_rows`: (code - 2^(bits-1)) · scale."""
    codes, scales = quantize_rows(rows, bits, block_size)
    if bits == 4:
        codes = np.stack([codes & 0xF, codes >> 4], -1).reshape(*codes.shape[:-1], -1)
    values = (codes.astype(np.float32) - (1 << (bits - 1))) * scales[..., None]
    return values.reshape(rows.shape)


def quantize_channels(rows: np.ndarray, code_max: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows [n, K] -> (int8 codes [n, K], float32 scales [n]): symmetric, one scale per row (an output
    channel) mapping its largest magnitude to `code_max`; w ≈ code · scale."""
    scales = np.abs(rows).max(axis=1) / code_max
    scales[scales == 0] = 1.0
    codes = np.clip(np.rint(rows / scales[:, None]), -code_max, code_max).astype(np.int8)
    return codes, scales.astype(np.float32)


def channel_quantized_values(rows: np.ndarray, code_max: int) -> np.ndarray:
    """float32 rows [n, K] as a w8a8 graph computes with them after `quantize_channels`."""
    codes, scales = quantize_channels(rows, code_max)
    return codes.astype(np.float32) * scales[:, None]


def format_values(rows: np.ndarray, weights: WeightFormat) -> np.ndarray:
    """float32 rows [n, K] as an engine of the quantized format `weights` computes with them."""
    if weights.per_channel:
        return channel_quantized_values(rows, weights.code_max)
    if weights.int4_rows:
        return int4_rows.unpack(*int4_rows.pack(rows))[: len(rows)]
    return quantized_values(rows, weights.bits, weights.block_size)


class ExternalData:
    """Appends tensors to `{graph}.data` beside the graph file and builds the referencing TensorProtos."""

    def __init__(self, graph_file: Path):
        self.location = graph_file.name + ".data"
        self.path = graph_file.with_name(self.location)
        self.handle = self.path.open("wb")
        self.offset = 0

    def add(self, name: str, array: np.ndarray, dtype: str) -> TensorProto:
        return self.add_chunks(name, array.shape, dtype, [np.ascontiguousarray(array)])

    def add_chunks(
        self, name: str, shape: Sequence[int], dtype: str, chunks: Iterator[np.ndarray] | list
    ) -> TensorProto:
        """A tensor written as consecutive chunks (its rows in order), never held whole."""
        padding = (-self.offset) % ALIGN
        self.handle.write(b"\0" * padding)
        self.offset += padding
        start = self.offset
        for chunk in chunks:
            data = chunk.tobytes()
            self.handle.write(data)
            self.offset += len(data)
        tensor = TensorProto(name=name, data_type=ONNX_DTYPES[dtype], dims=list(shape))
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", str(start)), ("length", str(self.offset - start))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        return tensor

    def close(self) -> None:
        self.handle.close()


class Weights:
    """`weights(name)` streams a tensor into the external data on first use, in the graph's dtype, and returns
    its initializer name; `linear` and `embedding` use a [out, in] weight in the weight format.

    A weight whose input width the block size does not divide is an error (`strict`, the target's case: the
    build checks the widths first) or stays in float (a drafter's small heads, e.g. a Markov rank below the
    block size)."""

    def __init__(
        self,
        read: Reader,
        store: ExternalData | None,
        dtype: str,
        weight_format: WeightFormat = WeightFormat(),
        progress: Callable[[int], None] | None = None,
        strict: bool = True,
        lender: "Weights | None" = None,
        borrowed: dict[str, str] | None = None,
        carrier: Carrier | None = None,
        coupled_rows: bool = False,
    ):
        """`lender` holds another graph's initializers (`lend_from`): the tensors `borrowed` maps (our name -> its
        name) are used from there, in its format and dtype, and stored once for both graphs. With a quantized format,
        a `carrier`'s own quantized matrices (a GGUF's Q4_0, Q8_0, Q6_K) are stored as they are, in their own
        layout, not quantized again. `coupled_rows`: w8a8 products may quantize all rows of an input with one scale
        (ONNX Runtime's fused `DynamicQuantizeMatMul`, no per-row ops): a row then depends on its batch, which a
        drafter may (its drafts are guesses the target verifies, drawn from what it returns), a target not."""
        self.coupled_rows = coupled_rows
        self.read, self.store, self.dtype, self.format, self.progress = read, store, dtype, weight_format, progress
        self.carrier = carrier
        self.strict, self.lender, self.borrowed = strict, lender, (borrowed or {}) if lender else {}
        self.initializers: dict[str, TensorProto] = {}
        self._row_quantized: dict[tuple[int, str], tuple[str, str]] = {}

    @classmethod
    def lend_from(cls, graph_file: Path, read: Reader, dtype: str, weight_format: WeightFormat) -> "Weights":
        """The initializers of a built graph (references to its external data, nothing loaded), ready to lend."""
        import onnx

        lender = cls(read, None, dtype, weight_format)
        lender.initializers = {
            t.name: t for t in onnx.load(str(graph_file), load_external_data=False).graph.initializer
        }
        return lender

    def _borrow(self, b: GraphBuilder, x: str, name: str, emit: Callable[["Weights", str, str], str],
                float_input: bool = True) -> str:
        """`emit(lender, x, its name)` in the lender's dtype, between casts from (a float `x`) and back to ours."""
        lender, theirs = self.lender, self.borrowed[name]
        keys = [theirs]
        if theirs + K_QUANT_SUFFIXES[0] in lender.initializers:
            keys = [theirs + suffix for suffix in K_QUANT_SUFFIXES]
        elif lender._quantizes(theirs) and lender.format.int4_rows:
            keys = [theirs + TILES, theirs + TILE_SCALES]
        elif lender._quantizes(theirs):  # w8a8 lays codes out for products and, apart, for an embedding's gathers
            codes = ".rows" if lender.format.per_channel and not float_input else ".q"
            keys = [theirs + codes, theirs + ".scales"] + [theirs + ".zp"] * (theirs + ".zp" in lender.initializers)
        missing = [key for key in keys if key not in lender.initializers]
        if missing:
            raise ConfigError(f"the target graph has no initializer {missing[0]} to share")
        self.initializers |= {key: lender.initializers[key] for key in keys}
        if lender.dtype == self.dtype:
            return emit(lender, x, theirs)
        cast = lambda value, dtype: b.op("Cast", value, to=ONNX_DTYPES[dtype])  # noqa: E731
        return cast(emit(lender, cast(x, lender.dtype) if float_input else x, theirs), self.dtype)

    def _quantizes(self, name: str) -> bool:
        if self.format.bits is None:
            return False
        outputs, width = self.read(name)[0].shape
        if self.format.int4_rows and width % int4_rows.BLOCK:
            if self.strict:
                raise ConfigError(f"w4a8 needs input widths that 32 divides; {name} is {outputs} x {width}")
            return False
        if self.format.int4_rows and outputs % int4_rows.TILE and not self.strict:
            return False  # a drafter's small head (the confidence's one output) stays float; a target's is padded
        if self.format.int4_rows or self.format.per_channel or width % self.format.block_size == 0:
            return True
        if self.strict:
            raise ConfigError(
                f"--quant-block-size {self.format.block_size} does not divide the input width {width} of {name}"
            )
        return False

    def _add(self, name: str, array: np.ndarray, dtype: str) -> str:
        self.initializers[name] = self.store.add(name, array, dtype)
        return name

    def _done(self, count: int = 1) -> None:
        if self.progress:
            self.progress(count)

    def __call__(self, name: str) -> str:
        if name not in self.initializers:
            self._add(name, convert(*self.read(name), self.dtype), self.dtype)
            self._done()
        return name

    def linear(self, b: GraphBuilder, x: str, names: str | Sequence[str],
               bias: str | Sequence[str] | None = None) -> str:
        """x [.., in] @ W[out, in]^T (+ the bias [out]) -> [.., out]; several `names` (and biases) are one projection
        onto their concatenated outputs (e.g. q, k and v)."""
        names = [names] if isinstance(names, str) else list(names)
        if names[0] in self.borrowed and len(names) == 1 and bias is None:
            return self._borrow(b, x, names[0], lambda lender, x, name: lender.linear(b, x, name))
        biases = [] if bias is None else [bias] if isinstance(bias, str) else list(bias)
        if not self._quantizes(names[0]):
            return b.op("Gemm", x, self._tensor(names), *([self._tensor(biases)] if biases else []), transB=1)
        if self.format.per_channel:
            return self._integer_product(b, x, names, biases)
        if self.format.int4_rows:
            return self._sliced_product(b, b.op(int4_rows.MATMUL, x, *self._tiles(names), domain=DOMAIN), names, biases)
        if len(names) > 1 and len({self._layout_of(name) for name in names}) > 1:  # carried in different layouts
            return b.op("Concat", *[self.linear(b, x, name, biases[i] if biases else None)
                                    for i, name in enumerate(names)], axis=-1)
        k_quant = self._k_quant_tiles(names)
        if k_quant:  # a GGUF's K-quant blocks, multiplied as ggml multiplies them
            return self._sliced_product(b, b.op(k_quant_rows.MATMUL, x, *k_quant, domain=DOMAIN), names, biases)
        codes, scales, zero_points, layout, n, k = self._quantized(names)
        if self.carrier and self.carrier.rounds_activations(names[0]):  # as llama.cpp computes the file's blocks
            x = q8_k_rounding(b, x)
        extra = [zero_points or "", *([""] + [self._tensor(biases)] if biases else [])]
        while extra and not extra[-1]:
            extra.pop()
        y = b.op("MatMulNBits", x, codes, scales, *extra, domain="com.microsoft", K=k, N=n, bits=layout.bits,
                 block_size=layout.block_size, accuracy_level=self.format.accuracy_level)
        if not layout.offsets:
            return y
        blocks = b.op("Concat", b.op("Shape", x, end=-1), b.const([k // layout.block_size, layout.block_size]), axis=0)
        sums = b.op("ReduceSum", b.op("Reshape", x, blocks), b.const([-1]), keepdims=0)  # [.., K/block]
        return b.op("Add", y, b.op("MatMul", sums, "+".join(names) + ".offsets"))

    def _sliced_product(self, b: GraphBuilder, y: str, names: list[str], biases: list[str]) -> str:
        """A product over tiles of 8 columns without the last tile's padding columns, plus the biases."""
        n = sum(self.read(name)[0].shape[0] for name in names)
        if n % int4_rows.TILE:
            y = b.op("Slice", y, b.const([0]), b.const([n]), b.const([-1]))
        return b.op("Add", y, self._tensor(biases)) if biases else y

    def embedding(self, b: GraphBuilder, ids: str, name: str) -> str:
        """Rows `ids` of the [vocab, hidden] table `name`, dequantized in the graph when the format quantizes (the
        same codes serve a tied LM head)."""
        if name in self.borrowed:
            return self._borrow(b, ids, name, lambda lender, ids, theirs: lender.embedding(b, ids, theirs), False)
        if not self._quantizes(name):
            return b.op("Gather", self(name), ids)
        if self.format.int4_rows:  # rows of a [vocab, hidden] table are a tied head's output columns: one copy
            return b.op(int4_rows.GATHER, ids, *self._tiles([name]), domain=DOMAIN)
        k_quant = self._k_quant_tiles([name])
        if k_quant:
            return b.op(k_quant_rows.GATHER, ids, *k_quant, domain=DOMAIN)
        if self.format.per_channel:  # rows of the codes, laid out [vocab, hidden] beside a tied head's [hidden, vocab]
            codes, scales = self._channels([name], rows=True)
            flat = b.op("Reshape", ids, b.const([-1]))
            row_scales = b.op("Unsqueeze", b.op("Gather", scales, flat), b.const([-1]))
            return b.op("Mul", b.op("Cast", b.op("Gather", codes, flat), to=TensorProto.FLOAT), row_scales)
        codes, scales, zero_points, layout, vocab, hidden = self._quantized([name])
        # the codes as MatMulNBits stores them, [vocab, blocks, bytes per block], quantized along their last axis:
        # no reshape of the codes, which ONNX Runtime would fold into a second copy (only the scales get one)
        per_block = b.const([vocab, -1, 1])
        rows = b.op("GatherBlockQuantized", codes, ids, b.op("Reshape", scales, per_block),
                    *([b.op("Reshape", zero_points, per_block)] if zero_points else []), domain="com.microsoft",
                    bits=layout.bits, block_size=layout.block_size, gather_axis=0, quantize_axis=2)
        return b.op("Reshape", rows, b.const([-1, hidden]))

    def _tensor(self, names: list[str]) -> str:
        """The initializer of one tensor, or of several concatenated along their first axis."""
        if len(names) == 1:
            return self(names[0])
        key = "+".join(names)
        if key not in self.initializers:
            self._add(key, np.concatenate([convert(*self.read(name), self.dtype) for name in names]), self.dtype)
            self._done(len(names))
        return key

    def _integer_product(self, b: GraphBuilder, x: str, names: list[str], biases: list[str]) -> str:
        """x @ W^T in w8a8: x's rows quantized to int8 (`_row_codes`), an integer `MatMulInteger` with the int8
        weights, then the row's and the output channel's scales (and the bias)."""
        codes, scales = self._channels(names)
        if self.coupled_rows:
            return b.op("DynamicQuantizeMatMul", x, codes, scales, "", *([self._tensor(biases)] if biases else []),
                        domain="com.microsoft")
        row_codes, row_scales = self._row_codes(b, x)
        product = b.op("MatMulInteger", row_codes, codes, b.const(ACTIVATION_ZERO, np.uint8))
        y = b.op("Mul", b.op("Mul", b.op("Cast", product, to=TensorProto.FLOAT), scales), row_scales)
        return b.op("Add", y, self._tensor(biases)) if biases else y

    def _row_codes(self, b: GraphBuilder, x: str) -> tuple[str, str]:
        """x [.., K] as uint8 codes (zero at `ACTIVATION_ZERO`) and a scale per row [.., 1]: each row's largest
        magnitude maps to 127. Made once per input and graph, shared by the projections that read it (gate, up)."""
        key = (id(b), x)
        if key not in self._row_quantized:
            peak = b.op("ReduceMax", b.op("Abs", x), b.const([-1]), keepdims=1)
            scale = b.op("Max", b.op("Div", peak, b.const(127.0, np.float32)),
                         b.const(np.finfo(np.float32).tiny, np.float32))
            codes = b.op("QuantizeLinear", b.op("Div", x, scale), b.const(1.0, np.float32),
                         b.const(ACTIVATION_ZERO, np.uint8))  # round half to even, + the zero, as uint8
            self._row_quantized[key] = codes, scale
        return self._row_quantized[key]

    def _channels(self, names: list[str], rows: bool = False) -> tuple[str, str]:
        """The int8 codes and float32 scales [n] of the weights `names` stacked along their outputs, one scale per
        output channel (`quantize_channels`): codes [K, n] (`MatMulInteger`'s right side, which ONNX Runtime packs
        at load), or with `rows` [n, K] for gathering rows (an embedding), each stored where first asked for."""
        key = "+".join(names)
        codes_name, scales_name = key + (".rows" if rows else ".q"), key + ".scales"
        if codes_name not in self.initializers:
            arrays = [self.read(name) for name in names]
            k = arrays[0][0].shape[1]
            codes = np.empty((sum(array.shape[0] for array, _ in arrays), k), np.int8)
            scales, row = [], 0
            for array, stored in arrays:
                step = max(1, CHUNK_ELEMENTS // k)
                for start in range(0, array.shape[0], step):
                    chunk, chunk_scales = quantize_channels(as_float32(array[start : start + step], stored),
                                                            self.format.code_max)
                    codes[row : row + len(chunk)] = chunk
                    scales.append(chunk_scales)
                    row += len(chunk)
            table = codes if rows else codes.T
            step = max(1, CHUNK_ELEMENTS // table.shape[1])
            self.initializers[codes_name] = self.store.add_chunks(
                codes_name, table.shape, "int8",
                (np.ascontiguousarray(table[start : start + step]) for start in range(0, len(table), step)))
            if scales_name not in self.initializers:
                self._add(scales_name, np.concatenate(scales), "float32")
                self._done(len(names))
        return codes_name, scales_name

    def _tiles(self, names: list[str]) -> tuple[str, str]:
        """The w4a8 codes and float16 scales (`int4_rows.pack`) of the weights `names` stacked along their outputs,
        zero rows added to fill the last tile."""
        key = "+".join(names)
        codes_name, scales_name = key + TILES, key + TILE_SCALES
        if codes_name not in self.initializers:
            arrays = [self.read(name) for name in names]
            n, k = sum(array.shape[0] for array, _ in arrays), arrays[0][0].shape[1]
            step = max(int4_rows.TILE, CHUNK_ELEMENTS // k // int4_rows.TILE * int4_rows.TILE)
            scales = []

            def chunks() -> Iterator[np.ndarray]:  # stacked (q, k, v) rows whole, one matrix's a slice at a time
                rows, stored = (np.concatenate([as_float32(*array) for array in arrays]), "float32") \
                    if len(arrays) > 1 else arrays[0]
                for start in range(0, n, step):
                    codes, chunk_scales = int4_rows.pack(as_float32(rows[start : start + step], stored))
                    scales.append(chunk_scales)
                    yield codes

            shape = (-(-n // int4_rows.TILE), k // int4_rows.BLOCK, 4 * int4_rows.BLOCK)
            self.initializers[codes_name] = self.store.add_chunks(codes_name, shape, "uint8", chunks())
            self._add(scales_name, np.concatenate(scales), "float16")
            self._done(len(names))
        return codes_name, scales_name

    def _k_quant_tiles(self, names: list[str]) -> list[str] | None:
        """The `ai.dspark` K-quant inputs (`k_quant_rows.pack`) of the weights `names` stacked along their outputs,
        when the carrier holds them all as ggml blocks of one K-quant type (or a lender's graph has them); else None.
        Packed a slice of rows at a time: the codes streamed, the rest (a quarter of a byte a weight at most) held."""
        key = "+".join(names)
        inputs = [key + suffix for suffix in K_QUANT_SUFFIXES]
        if inputs[0] in self.initializers:
            return inputs
        blocks = [self.carrier.ggml_blocks(name) for name in names] if self.carrier and self.format.blocked else [None]
        if not all(blocks) or len({kind for kind, _ in blocks}) > 1:
            return None
        kind, k = blocks[0][0], self.read(names[0])[0].shape[1]
        rows = np.concatenate([raw for _, raw in blocks]) if len(blocks) > 1 else blocks[0][1]
        step = max(int4_rows.TILE, CHUNK_ELEMENTS // k // int4_rows.TILE * int4_rows.TILE)
        rest: dict[str, list[np.ndarray]] = {part: [] for part in k_quant_rows.PARTS[1:]}

        def codes() -> Iterator[np.ndarray]:
            for start in range(0, len(rows), step):
                packed = k_quant_rows.pack(rows[start : start + step], kind)
                for part in rest:
                    rest[part].append(packed[part])
                yield packed["codes"]

        shape = (-(-len(rows) // int4_rows.TILE), k // int4_rows.BLOCK, 4 * int4_rows.BLOCK)
        self.initializers[inputs[0]] = self.store.add_chunks(inputs[0], shape, "uint8", codes())
        for name, part in zip(inputs[1:], rest):
            self._add(name, np.concatenate(rest[part]), "float32" if part == "supers" else "uint8")
        self._done(len(names))
        return inputs

    def _layout_of(self, name: str) -> Layout:
        """The layout `name` is stored in: the carrier's own, else the format's."""
        carried = self.carrier and self.carrier.carried_layout(name)
        return carried or Layout(self.format.bits, self.format.block_size)

    def _quantized(self, names: list[str]) -> tuple[str, str, str | None, Layout, int, int]:
        """(codes, scales, zero points or None) initializers of the weights `names` stacked along their outputs, their
        layout, n and K: carried as the checkpoint holds them when it holds all of them in one layout, else
        quantized slice by slice. A graph's existing initializers (a lender's) tell their layout by their shapes."""
        key = "+".join(names)
        codes_name, scales_name, zero_name = key + ".q", key + ".scales", key + ".zp"
        arrays = [self.read(name) for name in names]
        k = arrays[0][0].shape[1]
        n = sum(array.shape[0] for array, _ in arrays)
        if codes_name in self.initializers:
            blocks, blob = self.initializers[codes_name].dims[1:]
            zero = zero_name in self.initializers
            layout = Layout(blob * 8 // (k // blocks), k // blocks, zero, key + ".offsets" in self.initializers)
            return codes_name, scales_name, zero_name if zero else None, layout, n, k
        layout = self._layout_of(names[0])  # one layout per stack: `linear` splits stacks of mixed layouts
        step = max(1, CHUNK_ELEMENTS // k)
        scales, zero_points, offsets = [], [], []

        def chunks() -> Iterator[np.ndarray]:
            for name, (array, stored) in zip(names, arrays):
                carried = self.carrier and self.carrier.carried_layout(name) == layout and self.carrier.carried(name)
                if carried:  # the checkpoint's own codes, as they are
                    scales.append(carried.scales)
                    zero_points.append(carried.zero_points)
                    offsets.append(carried.offsets)
                    yield carried.codes
                    continue
                for start in range(0, array.shape[0], step):
                    codes, chunk_scales = quantize_rows(as_float32(array[start : start + step], stored), layout.bits,
                                                        layout.block_size)
                    scales.append(chunk_scales)
                    yield codes

        blob = layout.block_size * layout.bits // 8
        self.initializers[codes_name] = self.store.add_chunks(codes_name, (n, k // layout.block_size, blob), "uint8",
                                                              chunks())
        self._add(scales_name, np.concatenate(scales).astype(self.dtype), self.dtype)
        if layout.zero_points:  # only carried layouts have them, so every part was carried
            self._add(zero_name, np.concatenate(zero_points), "uint8")
        if layout.offsets:  # [K/block, n]: what the input's block sums multiply
            self._add(key + ".offsets", np.ascontiguousarray(np.concatenate(offsets).T), "float32")
        self._done(len(names))
        return codes_name, scales_name, zero_name if layout.zero_points else None, layout, n, k
