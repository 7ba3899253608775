"""A GGUF file's header read once and within bounds: every count the file claims (metadata entries, array lengths,
string lengths, tensors, dimensions) is checked against the bytes actually behind it before anything is allocated
for it, every value must have the type it declares (strings valid UTF-8), and every tensor must lie aligned inside
the data section, its size what its shape and type imply, overlapping no other and followed by no more than the
alignment's padding (a type relabelled to a smaller one leaves a gap). Tensor data is mapped, not read.

Errors are `CheckpointError`s naming the file, the field and what was expected. The GGUF layout (versions 2 and 3):
magic, version, tensor count, metadata count (little-endian), the metadata as (key, type, value), the tensor infos
as (name, dimensions, type, offset), then the data section at the next multiple of `general.alignment` (32).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dspark_common.errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
ALIGNMENT = 32  # the data section's default alignment
STRING, ARRAY, BOOL = 8, 9, 7
SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
           BOOL: np.uint8, 10: np.uint64, 11: np.int64, 12: np.float64}  # GGUF value type -> its numpy type
TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", BOOL: "bool",
              STRING: "string", ARRAY: "array", 10: "uint64", 11: "int64", 12: "float64"}
INTEGERS = (0, 1, 2, 3, 4, 5, 10, 11)
FLOATS = (6, 12)
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS


def type_name(kind: int | tuple[int, int]) -> str:
    """A GGUF value type's name ("array of string" for an array's)."""
    if isinstance(kind, tuple):
        return f"array of {type_name(kind[1])}"
    return TYPE_NAMES.get(kind, f"type {kind}")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: its name, its dimensions as stored (ggml order: the row length first), its ggml type,
    where its bytes lie in the file, and the file they lie in."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any  # gguf.GGMLQuantizationType
    offset: int  # from the start of the file
    n_bytes: int
    file: Path

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes, mapped: float and integer types as their numbers, quantized ones as uint8 rows."""
        dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "I8": np.int8,
                 "I16": np.int16, "I32": np.int32, "I64": np.int64}.get(self.tensor_type.name, np.uint8)
        rows = int(np.prod(self.shape[1:], dtype=np.int64))
        return np.memmap(self.file, dtype=dtype, mode="r", offset=self.offset,
                         shape=(rows, self.n_bytes // rows // np.dtype(dtype).itemsize))


@dataclass(frozen=True)
class GGUFContents:
    """The metadata (key -> value: str, int, float, bool, or a list / numpy array for arrays), each key's declared
    type (an array's as (ARRAY, element type)), and the tensors, in file order."""

    fields: dict[str, Any]
    types: dict[str, int | tuple[int, int]]
    tensors: list[TensorInfo]


class _Cursor:
    """Reads the header front to back, refusing to read past the end of the file."""

    def __init__(self, buffer: mmap.mmap, file: Path):
        self.buffer, self.file, self.at = buffer, file, 0

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.file} is not a valid GGUF file: {what}")

    def take(self, size: int, what: str) -> memoryview:
        if size < 0 or self.at + size > len(self.buffer):
            raise self.fail(f"{what} runs past the end of the file (truncated or a count too large)")
        view = memoryview(self.buffer)[self.at : self.at + size]
        self.at += size
        return view

    def scalar(self, kind: int, what: str) -> Any:
        dtype = np.dtype(SCALARS[kind]).newbyteorder("<")
        return np.frombuffer(self.take(dtype.itemsize, what), dtype)[0].item()

    def string(self, what: str) -> str:
        size = self.scalar(10, f"the length of {what}")
        try:
            return bytes(self.take(size, what)).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def value(self, kind: int, what: str) -> Any:
        if kind == STRING:
            return self.string(what)
        if kind == BOOL:
            flag = self.scalar(0, what)
            if flag > 1:
                raise self.fail(f"{what} is a bool stored as {flag}")
            return bool(flag)
        return self.scalar(kind, what)

    def array(self, key: str) -> tuple[int, Any]:
        kind = self.scalar(4, f"the element type of {key}")
        count = self.scalar(10, f"the length of {key}")
        if kind == STRING:
            if count * 8 > len(self.buffer) - self.at:  # every string takes its 8-byte length at least
                raise self.fail(f"{key} claims {count} strings, more than the rest of the file can hold")
            return kind, [self.string(f"{key}[{index}]") for index in range(count)]
        if kind not in SCALARS:
            raise self.fail(f"{key} is an array of type {kind}, which GGUF arrays cannot hold"
                            + (" (nested arrays)" if kind == ARRAY else ""))
        dtype = np.dtype(SCALARS[kind]).newbyteorder("<")
        values = np.frombuffer(self.take(count * dtype.itemsize, key), dtype).astype(SCALARS[kind])
        return kind, values.astype(bool) if kind == BOOL else values


def read_gguf(file: str | Path) -> GGUFContents:
    """Parse `file`'s header and tensor table within the bounds described above."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    file = Path(file)
    try:
        with file.open("rb") as handle:
            buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
        raise CheckpointError(f"{file} cannot be read as a GGUF file: {exc}") from None
    with buffer:
        cursor = _Cursor(buffer, file)
        if bytes(cursor.take(4, "the magic")) != MAGIC:
            raise cursor.fail("it does not start with GGUF's magic")
        version = cursor.scalar(4, "the version")
        if version not in VERSIONS:
            raise cursor.fail(f"version {version} (DSpark reads versions {', '.join(map(str, VERSIONS))})")
        tensor_count, field_count = cursor.scalar(10, "the tensor count"), cursor.scalar(10, "the metadata count")
        room = len(buffer) - cursor.at
        if field_count * 13 > room or tensor_count * 32 > room:  # the smallest entry of each: key/name, type, value
            raise cursor.fail(f"it claims {field_count} metadata entries and {tensor_count} tensors, more than its "
                              f"{len(buffer)} bytes can hold")
        fields, types = {}, {}
        for _ in range(field_count):
            key = cursor.string("a metadata key")
            if key in fields:
                raise cursor.fail(f"metadata key {key!r} appears twice")
            kind = cursor.scalar(4, f"the type of {key}")
            if kind == ARRAY:
                element, fields[key] = cursor.array(key)
                types[key] = (ARRAY, element)
            elif kind in TYPE_NAMES:
                fields[key], types[key] = cursor.value(kind, key), kind
            else:
                raise cursor.fail(f"metadata {key!r} has value type {kind}, which GGUF does not define")
        alignment = fields.get("general.alignment", ALIGNMENT)
        if types.get("general.alignment", 4) != 4 or alignment < 1 or alignment & (alignment - 1):
            raise cursor.fail(f"general.alignment {alignment!r} is not a uint32 power of two")
        infos = []
        for index in range(tensor_count):
            name = cursor.string(f"the name of tensor {index}")
            dims = cursor.scalar(4, f"the dimension count of {name}")
            if not 1 <= dims <= MAX_DIMS:
                raise cursor.fail(f"tensor {name} has {dims} dimensions (1 to {MAX_DIMS})")
            shape = tuple(cursor.scalar(10, f"a dimension of {name}") for _ in range(dims))
            kind = cursor.scalar(4, f"the type of {name}")
            offset = cursor.scalar(10, f"the offset of {name}")
            infos.append((name, shape, kind, offset))
        start = -(-cursor.at // alignment) * alignment
        tensors, names = [], set()
        for name, shape, kind, offset in infos:
            if name in names:
                raise cursor.fail(f"tensor {name} appears twice")
            names.add(name)
            try:
                ggml_type = GGMLQuantizationType(kind)
                block, size = GGML_QUANT_SIZES[ggml_type]
            except (ValueError, KeyError):
                raise cursor.fail(f"tensor {name} has ggml type {kind}, which ggml does not define") from None
            if min(shape) < 1 or any(n >= 1 << 40 for n in shape):
                raise cursor.fail(f"tensor {name} has dimensions {list(shape)}")
            if shape[0] % block:
                raise cursor.fail(f"tensor {name}: rows of {shape[0]} do not divide into {ggml_type.name} blocks "
                                  f"of {block}")
            n_bytes = int(np.prod(shape, dtype=object)) // block * size
            if offset % alignment:
                raise cursor.fail(f"tensor {name} starts at offset {offset}, not a multiple of {alignment}")
            if start + offset + n_bytes > len(buffer):
                raise cursor.fail(f"tensor {name} ({n_bytes} bytes at offset {offset}) ends past the end of the file")
            tensors.append(TensorInfo(name, shape, ggml_type, start + offset, n_bytes, file))
        ordered = sorted(tensors, key=lambda t: t.offset)
        for first, second in zip(ordered, ordered[1:]):
            if first.offset + first.n_bytes > second.offset:
                raise cursor.fail(f"tensors {first.name} and {second.name} overlap")
            if second.offset - (first.offset + first.n_bytes) >= alignment:  # writers pad to the alignment, no more
                raise cursor.fail(f"tensor {first.name} ({first.tensor_type.name}, {first.n_bytes} bytes) is followed "
                                  f"by {second.offset - first.offset - first.n_bytes} unused bytes: its type or shape "
                                  "does not describe its data")
    return GGUFContents(fields, types, tensors)
