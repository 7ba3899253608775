"""Hugging Face safetensors checkpoints (single file or sharded), read lazily without torch.

Tensors are memory-mapped and handed out one at a time, so an 8B checkpoint never sits whole in
memory. bfloat16, which numpy lacks, comes back as its raw uint16 bits (`as_float32` widens it).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_export.config import DecoderConfig
from dspark_common.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.bin")
# safetensors dtype name -> (numpy storage dtype, our dtype name); integer tensors are vocabulary maps (d2t)
_DTYPES = {
    "F32": (np.float32, "float32"),
    "F16": (np.float16, "float16"),
    "BF16": (np.uint16, "bfloat16"),
    "I64": (np.int64, "int64"),
    "I32": (np.int32, "int32"),
    "BOOL": (np.bool_, "bool"),
}
_STORAGE = {dtype: storage for storage, dtype in _DTYPES.values()}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # "float32" | "float16" | "bfloat16"
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors file's header, checking that every tensor lies inside the file."""
    try:
        size = file.stat().st_size
        with file.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{file} is not a safetensors file (truncated header)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{file} is corrupt (header length {header_len} exceeds the file)")
            header = json.loads(handle.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{file} is corrupt (its header is not valid JSON)") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {file}: {exc.strerror}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file} is corrupt (its header is not a JSON object)")
    data_start = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file} is corrupt (bad header entry for {name})") from None
        if dtype_name not in _DTYPES:
            raise CheckpointError(f"{file}: tensor {name} has dtype {dtype_name}; DSpark reads {', '.join(_DTYPES)}")
        storage, dtype = _DTYPES[dtype_name]
        nbytes = math.prod(shape) * np.dtype(storage).itemsize
        if end - begin != nbytes or begin < 0 or data_start + end > size:
            raise CheckpointError(f"{file} is corrupt or truncated (tensor {name} lies outside the file)")
        tensors[name] = TensorInfo(file, dtype, shape, data_start + begin, nbytes)
    return tensors


def write_safetensors(file: Path, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    """Write (array, dtype) pairs (bfloat16 as uint16 bits) as one safetensors file, one tensor at a time."""
    names = {dtype: name for name, (_, dtype) in _DTYPES.items()}
    header, offset = {}, 0
    for name, (array, dtype) in tensors.items():
        size = array.size * np.dtype(_STORAGE[dtype]).itemsize
        header[name] = {"dtype": names[dtype], "shape": list(array.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with file.open("wb") as handle:
        handle.write(struct.pack("<Q", len(blob)) + blob)
        for array, dtype in tensors.values():
            handle.write(np.ascontiguousarray(array, dtype=_STORAGE[dtype]).tobytes())


def tensor_view(info: TensorInfo) -> np.ndarray:
    """A read-only memory map of one tensor (bfloat16 as uint16 bits)."""
    return np.memmap(info.file, dtype=_STORAGE[info.dtype], mode="r", offset=info.start, shape=info.shape)


def as_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    """Widen a stored tensor (bfloat16 given as uint16 bits) to float32."""
    if dtype == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def expected_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this architecture must hold, by its Hugging Face name."""
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if config.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
    return shapes


def index_tensors(folder: Path) -> dict[str, TensorInfo]:
    """Every tensor of a folder's `model.safetensors`, or of the shards its index lists. A folder with only a
    pickled checkpoint is refused without opening it (unpickling runs arbitrary code)."""
    index_file, single_file = folder / INDEX_FILE, folder / SINGLE_FILE
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            raise CheckpointError(f"{index_file} is corrupt (no readable weight_map)") from None
        tensors: dict[str, TensorInfo] = {}
        for shard in sorted(set(weight_map.values())):
            if not (folder / shard).is_file():
                raise CheckpointError(f"shard {shard} listed in {INDEX_FILE} is missing from {folder}")
            header = read_header(folder / shard)
            tensors |= {name: info for name, info in header.items() if weight_map.get(name) == shard}
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise CheckpointError(f"{INDEX_FILE} names tensors its shards lack, e.g. {missing[0]}")
        return tensors
    if single_file.is_file():
        return read_header(single_file)
    pickled = next((name for name in PICKLE_FILES if (folder / name).is_file()), None)
    if pickled:
        raise CheckpointError(
            f"{folder / pickled} is a pickle, which DSpark never loads (unpickling can run code); convert it once "
            "with: python -c \"import torch; from safetensors.torch import save_file; "
            f"save_file(torch.load('{pickled}', weights_only=True), 'model.safetensors')\"")
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {folder}")


class Checkpoint:
    """The tensors of one checkpoint folder, by name, checked against its architecture."""

    def __init__(self, path: str | Path, config: DecoderConfig):
        self.path = Path(path)
        self.config = config
        self.tensors = index_tensors(self.path)
        self._check_shapes()

    def _check_shapes(self) -> None:
        for name, shape in expected_shapes(self.config).items():
            if name not in self.tensors:
                raise CheckpointError(f"checkpoint {self.path} lacks tensor {name}")
            if self.tensors[name].shape != shape:
                raise CheckpointError(
                    f"tensor {name} has shape {list(self.tensors[name].shape)}, expected {list(shape)} from config.json"
                )

    @property
    def dtype(self) -> str:
        """The storage dtype of the checkpoint's weights."""
        return self.tensors["model.embed_tokens.weight"].dtype

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        """A read-only memory map of one tensor and its dtype (bfloat16 as uint16 bits)."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"checkpoint {self.path} has no tensor {name}")
        return tensor_view(info), info.dtype

    def float32(self, name: str) -> np.ndarray:
        """One tensor widened to float32 (a copy)."""
        return as_float32(*self.raw(name))

    def carried_layout(self, name: str) -> None:
        """Safetensors hold float weights: nothing to carry into a quantized engine as it is (a GGUF may)."""
        return None

    def carried(self, name: str) -> None:
        return None

    def rounds_activations(self, name: str) -> bool:
        return False

    def ggml_blocks(self, name: str) -> None:
        return None

    def k_quants(self) -> bool:
        return False

    def lm_head_name(self) -> str:
        return "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"

