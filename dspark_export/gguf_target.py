"""GGUF targets (the files llama.cpp, Ollama and LM Studio keep): the header read and checked by `gguf_reader` and
`gguf_checks`, the quantized blocks dequantized by the `gguf` package.

`prepare(file)` turns a `.gguf` into what the rest of the exporter reads from a Hugging Face folder: a small
side folder with `config.json`, `tokenizer.json` and `tokenizer_config.json` made from the file's metadata, and
the file itself linked in as `model.gguf`. `GGUFCheckpoint` hands out its tensors by their Hugging Face names:
F32/F16/BF16 as stored, every quantized type dequantized a few rows at a time, and Q4_0, Q8_0, Q6_K, Q4_K and Q5_K
also as `MatMulNBits` codes and scales in their own layout (`carried`), so that a quantized engine computes with the
file's own numbers: Q4_0 is (q - 8)·d with q a nibble and Q8_0 q·d with q a signed byte, in blocks of 32 with one float16
scale (MatMulNBits' layout once the nibbles are re-paired and the bytes offset by 128); Q6_K is d·s·(q - 32) per
16 weights (8-bit codes in blocks of 16 with zero point 32); Q4_K and Q5_K are d·sc·q - dmin·m per 32 weights (codes
with zero point 0, scales d·sc, and offsets -dmin·m that their products add as a float product with the input's
per-32 sums). K-quant products round their activations as llama.cpp's do (`rounds_activations`). Where DSpark's
own operators build (x86-64 with a C compiler), K-quant matrices go to them instead as their raw blocks
(`ggml_blocks`), multiplied as ggml multiplies them.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np

from dspark_export.config import ARCHITECTURES, DecoderConfig, llama3_scaled
from dspark_export.gguf_checks import FLOAT, INTEGER, check_file, check_tokenizer
from dspark_export.gguf_reader import ARRAY, BOOL, FLOATS, INTEGERS, STRING, GGUFContents, read_gguf, type_name
from dspark_export.graphs.weights import Carried, Layout, WeightFormat
from dspark_export.staging import remove_orphans
from dspark_common import k_quant_rows, native
from dspark_common.errors import CheckpointError

GGUF_FILE = "model.gguf"  # the link to the file inside a prepared side folder
ROPE_FREQS = "rope_freqs.weight"  # Llama 3's rotary scaling, stored as a divisor per frequency
LLAMA3_BANDS = (1.0, 4.0, 8192)  # Meta's llama3 low_freq_factor, high_freq_factor, original context, every Llama 3.x
LAYER_NAMES = {  # llama.cpp's per-layer tensor names -> Hugging Face's
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
CARRIED_BLOCK = 32
EXACT = 1e-6  # a relative RMS error of re-quantization below this is float rounding: the format holds the grid
CARRIED = {  # GGUF types whose blocks `MatMulNBits` holds exactly, and how
    "Q4_0": Layout(4, CARRIED_BLOCK), "Q8_0": Layout(8, CARRIED_BLOCK), "Q6_K": Layout(8, 16, zero_points=True),
    "Q4_K": Layout(4, 32, zero_points=True, offsets=True), "Q5_K": Layout(8, 32, zero_points=True, offsets=True)}
OFFSET_TYPES = ("Q4_K", "Q5_K")  # d·sc·q - dmin·m: carried for products only (a gathered row has no offset term)
K_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176}  # 256 weights: d, dmin (float16), 12 bytes of 6-bit sc and m, codes
# carried types whose ggml products round activations to Q8_K (`ggml_rounding`)
ROUNDS_ACTIVATIONS = ("Q6_K", "Q4_K", "Q5_K")
Q6_K_BYTES, Q6_K_SCALES = 210, slice(192, 208)  # a 256-weight Q6_K block: ql[128], qh[64], scales[16] (int8), d
FLOAT_TYPES = ("F32", "F16", "BF16")
ROW_CHUNK = 1 << 22  # weights dequantized at a time
# the split pattern of each byte-level pre-tokenizer llama.cpp names (`tokenizer.ggml.pre`); None: GPT-2's own
PRE_TOKENIZERS = {
    "gpt-2": None,
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
CONTROL, USER_DEFINED, UNUSED = 3, 4, 5  # llama.cpp's token types: special, added, and padding rows ([PAD123])


def is_gguf(path: str | Path) -> bool:
    """A `.gguf` name, or a file that starts with GGUF's magic (Ollama keeps its files as blobs without a suffix)."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as handle:
            return handle.read(4) == b"GGUF"
    except OSError:
        return False


def _contents(file: Path) -> GGUFContents:
    """The file's header, metadata and tensor table (`gguf_reader`), or a one-line error for a missing, truncated,
    foreign or malformed file."""
    try:
        import gguf  # noqa: F401  (the ggml types and the dequantizers)
    except ImportError:
        raise CheckpointError("reading GGUF files needs the gguf package (1.4 MB): pip install gguf") from None
    if not file.is_file():
        raise CheckpointError(f"GGUF file {file} does not exist")
    return read_gguf(file)


class GGUFFile:
    """A GGUF file's metadata (fields by key) and tensors (by their Hugging Face names), checked (`gguf_checks`)
    before anything is made of them."""

    def __init__(self, file: str | Path):
        self.file = Path(file)
        self.contents = _contents(self.file)
        self.architecture = self.field("general.architecture", kind=STRING)
        if self.architecture not in ARCHITECTURES:  # llama.cpp names these families as Hugging Face's model_type
            raise CheckpointError(f"{self.file.name}: GGUF architecture {self.architecture!r} is not one DSpark builds "
                                  f"(it reads {', '.join(ARCHITECTURES)})")
        self.tensors, self.rope_freqs = {}, None
        for tensor in self.contents.tensors:
            if tensor.name == ROPE_FREQS and self.architecture == "llama":
                self.rope_freqs = np.asarray(tensor.data, np.float64).reshape(-1)
                continue
            name = _hf_name(tensor.name)
            if name is None:
                raise CheckpointError(f"{self.file.name}: tensor {tensor.name} has no place in a "
                                      f"{self.architecture} decoder")
            self.tensors[name] = tensor
        check_file(self)

    @cached_property
    def tokenizer(self) -> tuple[list[str], np.ndarray, list[tuple[str, str]]]:
        """The tokens, their types and the merges, checked once (`check_tokenizer`)."""
        return check_tokenizer(self)

    def has(self, key: str) -> bool:
        return key in self.contents.fields

    def field(self, key: str, default=None, kind: int | tuple | None = None):
        """The value of metadata `key` (`default` when absent; an error when absent without one, or when it is not
        of the type `kind` names: a GGUF value type, INTEGER or FLOAT, or (ARRAY, element type))."""
        if key not in self.contents.fields:
            if default is None:
                raise CheckpointError(f"{self.file.name} lacks the GGUF metadata {key}")
            return default
        stored = self.contents.types[key]
        integer_arrays = [(ARRAY, k) for k in INTEGERS]
        allowed = {INTEGER: INTEGERS, FLOAT: FLOATS, (ARRAY, INTEGER): integer_arrays}.get(kind, (kind,))
        if kind is not None and stored not in allowed:
            expected = {INTEGER: "an integer", FLOAT: "a float", (ARRAY, INTEGER): "an array of integers"}.get(kind)
            raise CheckpointError(f"{self.file.name}: metadata {key} is {type_name(stored)}, expected "
                                  f"{expected or type_name(kind)}")
        return self.contents.fields[key]

    def config(self) -> DecoderConfig:
        return DecoderConfig.from_hf_dict(self.hf_config())

    def hf_config(self) -> dict:
        """config.json's fields, from the metadata."""
        arch = self.architecture
        heads = int(self.field(f"{arch}.attention.head_count"))
        hidden = int(self.field(f"{arch}.embedding_length"))
        head_dim = int(self.field(f"{arch}.attention.key_length", hidden // heads))
        theta = _decimal(self.field(f"{arch}.rope.freq_base", 10000.0))
        return {
            "architectures": [ARCHITECTURES[arch].hf_class],
            "model_type": arch,
            "vocab_size": int(self.tensors["model.embed_tokens.weight"].shape[1]),
            "hidden_size": hidden,
            "intermediate_size": int(self.field(f"{arch}.feed_forward_length")),
            "num_hidden_layers": int(self.field(f"{arch}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.field(f"{arch}.attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "rms_norm_eps": _decimal(self.field(f"{arch}.attention.layer_norm_rms_epsilon")),
            "rope_theta": theta,
            "rope_scaling": None if self.rope_freqs is None else self._llama3_scaling(theta, head_dim),
            "max_position_embeddings": int(self.field(f"{arch}.context_length")),
            "tie_word_embeddings": "lm_head.weight" not in self.tensors,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }

    def _llama3_scaling(self, theta: float, head_dim: int) -> dict:
        """config.json's llama3 `rope_scaling` that gives the file's `rope_freqs` (llama.cpp divides each rotary
        frequency by its entry): the factor is the largest divisor, the bands Meta's, the original context read
        off a divisor between 1 and the factor (8192 when none is); refused when they do not reproduce the file's."""
        freqs, (low, high, original) = self.rope_freqs, LLAMA3_BANDS
        factor = float(np.float32(freqs.max()))
        base = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
        wavelength = 2 * np.pi / base
        between = (freqs > 1 + 1e-6) & (freqs < factor * (1 - 1e-6))
        if between.any() and factor > 1:  # 1/divisor = (1 - s)/factor + s, s = (original/wavelength - low)/(high - low)
            blend = (1 / freqs[between] - 1 / factor) / (1 - 1 / factor)
            original = int(round(float(np.median((blend * (high - low) + low) * wavelength[between]))))
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                   "original_max_position_embeddings": original}
        if len(freqs) != head_dim // 2 or not np.allclose(llama3_scaled(base, factor, low, high, original),
                                                           base / freqs, rtol=1e-5, atol=0):
            raise CheckpointError(f"{self.file.name}: its {ROPE_FREQS} are no llama3 rotary scaling DSpark knows")
        return scaling

    def quantization_mix(self) -> dict[str, str]:
        """Each kind of matrix (q_proj, down_proj, embed_tokens, ...) and the GGUF types it is stored in."""
        kinds: dict[str, Counter] = {}
        for name, tensor in self.tensors.items():
            if len(tensor.shape) == 2:
                kind = name.split(".")[-2]
                kinds.setdefault(kind, Counter())[tensor.tensor_type.name] += 1
        return {kind: ", ".join(f"{t} x{n}" if n > 1 else t for t, n in types.items()) for kind, types in kinds.items()}

    def main_type(self) -> str:
        """The type most of the weights' bytes are stored in."""
        sizes = Counter()
        for tensor in self.tensors.values():
            sizes[tensor.tensor_type.name] += int(tensor.n_bytes)
        return sizes.most_common(1)[0][0]


def _decimal(value: float) -> float:
    """A float32 field as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(value)))


def _hf_name(name: str) -> str | None:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"
    return None


def natural_weights(gguf: GGUFFile) -> str:
    """The engine weight format a file's quantization maps onto: int4 for 4-bit types and below, int8 for 5- to
    8-bit ones (re-quantized to 4 bits they would lose what the user chose them for), fp32 for float files."""
    main = gguf.main_type()
    if main in FLOAT_TYPES:
        return "fp32"
    return "int8" if main.startswith(("Q8", "Q6", "Q5")) else "int4"


# ---- the tokenizer ---------------------------------------------------------------------------------------------
def tokenizer_json(gguf: GGUFFile) -> str:
    """tokenizer.json for a byte-level BPE vocabulary (`tokenizer.ggml.model` "gpt2"), made with `tokenizers`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    model = gguf.field("tokenizer.ggml.model", kind=STRING)
    pre = gguf.field("tokenizer.ggml.pre", "gpt-2", STRING)
    if model != "gpt2" or pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{gguf.file.name}: tokenizer {model}/{pre} is not one DSpark rebuilds (it reads gpt2 "
                              f"byte-level BPE with pre-tokenizer {', '.join(PRE_TOKENIZERS)})")
    tokens, kinds, merges = gguf.tokenizer
    vocab = {token: index for index, (token, kind) in enumerate(zip(tokens, kinds)) if kind != UNUSED}
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=False))
    pattern = PRE_TOKENIZERS[pre]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pattern is None)
    tokenizer.pre_tokenizer = byte_level if pattern is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([AddedToken(tokens[i], special=kinds[i] == CONTROL, normalized=False)
                          for i in range(len(tokens)) if kinds[i] in (CONTROL, USER_DEFINED)])
    return tokenizer.to_str()


def tokenizer_config(gguf: GGUFFile) -> dict:
    """tokenizer_config.json: the end, padding and (when the file adds it) beginning tokens, and the chat template."""
    tokens, _, _ = gguf.tokenizer
    named = lambda key: tokens[gguf.field(key)] if gguf.has(key) else None  # noqa: E731  (ids checked in range)
    config = {"eos_token": named("tokenizer.ggml.eos_token_id"), "pad_token": named("tokenizer.ggml.padding_token_id"),
              "bos_token": named("tokenizer.ggml.bos_token_id")
              if gguf.field("tokenizer.ggml.add_bos_token", False, BOOL) else None}
    if gguf.has("tokenizer.chat_template"):
        config["chat_template"] = gguf.field("tokenizer.chat_template", kind=STRING)
    return config


# ---- the side folder -------------------------------------------------------------------------------------------
def open_gguf(file: str | Path) -> GGUFFile:
    """`file` read and checked once per process while it is unchanged (a command reads it at several stages)."""
    file = _resolved(file)
    stat = file.stat() if file.is_file() else None
    return _opened(file, stat and (stat.st_size, stat.st_mtime_ns))


def _resolved(file: str | Path) -> Path:
    """The file a path names, links followed; a link loop is one error."""
    try:
        return Path(file).expanduser().resolve()
    except (RuntimeError, OSError) as exc:  # RuntimeError: a symlink loop (Python before 3.13)
        raise CheckpointError(f"{file} cannot be opened: {exc}") from None


@lru_cache(maxsize=4)
def _opened(file: Path, stamp: tuple[int, int] | None) -> GGUFFile:
    return GGUFFile(file)


SIDE_FOLDER = "dspark-gguf-"  # a prepared side folder's prefix; its suffix names the process that made it


def prepare(file: str | Path) -> tuple[Path, GGUFFile]:
    """A side folder (removed at exit) that reads as a Hugging Face model folder: config and tokenizer from the
    file's metadata, the file linked in as `model.gguf`; and the opened file. Side folders of processes that
    died without removing theirs (killed) are removed first."""
    file = _resolved(file)
    gguf = open_gguf(file)
    remove_orphans(Path(tempfile.gettempdir()).glob(SIDE_FOLDER + "*"))
    folder = Path(tempfile.mkdtemp(prefix=SIDE_FOLDER, suffix=f"-{os.getpid()}"))
    atexit.register(shutil.rmtree, folder, True)
    (folder / "config.json").write_text(json.dumps(gguf.hf_config(), indent=1))
    (folder / "tokenizer.json").write_text(tokenizer_json(gguf), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(gguf), indent=1), encoding="utf-8")
    (folder / GGUF_FILE).symlink_to(file)
    return folder, gguf


# ---- the weights -----------------------------------------------------------------------------------------------
def _q6_k(data: np.ndarray, rows: int, values: "Dequantized") -> Carried:
    """A Q6_K matrix's 6-bit codes (8-bit, zero point 32) and per-16 scales d·s from its blocks and its values."""
    blocks = data.reshape(rows, -1, Q6_K_BYTES)
    d = np.ascontiguousarray(blocks[..., -2:]).view(np.float16)[..., 0].astype(np.float32)  # [n, K/256]
    scales = (d[..., None] * blocks[..., Q6_K_SCALES].view(np.int8)).reshape(rows, -1)  # [n, K/16]
    wide = np.asarray(values).reshape(rows, scales.shape[1], 16)
    safe = np.where(scales == 0, 1, scales)[..., None]
    codes = (np.clip(np.rint(wide / safe), -32, 31) + 32).astype(np.uint8)
    return Carried(codes, scales.astype(np.float32), np.full(scales.shape, 32, np.uint8), CARRIED["Q6_K"])


def k_quant_scales(data: np.ndarray, rows: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_K or Q5_K matrix's per-32 scales d·sc and offsets -dmin·m [n, K/32], in float32 as ggml computes them
    (`get_scale_min_k4`: eight 6-bit sc and m per 256 weights, packed into 12 bytes)."""
    blocks = data.reshape(rows, -1, K_BLOCK_BYTES[kind])
    d, dmin = (np.ascontiguousarray(blocks[..., i : i + 2]).view(np.float16)[..., 0].astype(np.float32) for i in (0, 2))
    q = blocks[..., 4:16].astype(np.uint8)  # [n, B, 12]
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], axis=-1)
    scales = d[..., None] * sc.astype(np.float32)
    offsets = -(dmin[..., None] * m.astype(np.float32))
    return scales.reshape(rows, -1), offsets.reshape(rows, -1)


def _k_quant(data: np.ndarray, rows: int, values: "Dequantized", kind: str) -> Carried:
    """A Q4_K (4-bit) or Q5_K (5-bit, held in 8) matrix: codes q with zero points 0, scales d·sc and offsets -dmin·m
    per 32 weights, its codes read back from the dequantized values (exact: w = d·sc·q - dmin·m in float32)."""
    layout = CARRIED[kind]
    scales, offsets = k_quant_scales(data, rows, kind)
    wide = np.asarray(values).reshape(rows, scales.shape[1], 32)
    safe = np.where(scales == 0, 1, scales)[..., None]
    codes = np.clip(np.rint((wide - offsets[..., None]) / safe), 0, (1 << (4 if kind == "Q4_K" else 5)) - 1)
    codes = np.where(scales[..., None] == 0, 0, codes).astype(np.uint8)
    if layout.bits == 4:  # two to a byte, the even element low
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    zero_points = np.zeros((rows, -(-scales.shape[1] * layout.bits // 8)), np.uint8)
    return Carried(codes, scales, zero_points, layout, offsets)


@dataclass(frozen=True)
class Dequantized:
    """A quantized GGUF matrix as float32 [rows, columns], dequantized only for the rows a slice asks for."""

    data: np.ndarray  # [rows, bytes per row]
    qtype: object  # GGMLQuantizationType
    shape: tuple[int, int]

    def __getitem__(self, rows) -> np.ndarray:
        from gguf.quants import dequantize

        return dequantize(np.asarray(self.data[rows]), self.qtype).reshape(-1, self.shape[1])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self.astype(dtype or np.float32)

    def astype(self, dtype) -> np.ndarray:
        step = max(1, ROW_CHUNK // self.shape[1])
        return np.concatenate([self[start: start + step] for start in range(0, self.shape[0], step)]).astype(dtype)


class GGUFCheckpoint:
    """`Checkpoint`'s interface over a prepared GGUF: tensors by Hugging Face name (their set and shapes checked
    when the file was opened)."""

    def __init__(self, folder: Path, config: DecoderConfig):
        self.path, self.config = Path(folder), config
        self.gguf = open_gguf(self.path / GGUF_FILE)
        self.tensors = self.gguf.tensors

    @property
    def dtype(self) -> str:
        return "float32"

    def raw(self, name: str):
        """(array, dtype) as `Checkpoint.raw`: float tensors as stored, quantized ones as a `Dequantized` view."""
        tensor = self.tensors.get(name)
        if tensor is None:
            raise CheckpointError(f"{self.gguf.file.name} has no tensor for {name}")
        kind = tensor.tensor_type.name
        shape = tuple(int(n) for n in reversed(tensor.shape))
        data = self._rows(name)
        if kind == "F32":
            return data.reshape(shape), "float32"
        if kind == "F16":
            return data.reshape(shape), "float16"
        if kind == "BF16":
            return data.view(np.uint16).reshape(shape), "bfloat16"
        return Dequantized(data, tensor.tensor_type, shape), "float32"

    def _rows(self, name: str) -> np.ndarray:
        """The tensor as stored, [rows, values or bytes per row], its rows in Hugging Face's order: llama.cpp stores
        a Llama's q and k rows permuted per head (the rotary pairs interleaved, not in halves)."""
        tensor = self.tensors[name]
        data = np.asarray(tensor.data).reshape(int(tensor.shape[-1]), -1)
        heads = {"self_attn.q_proj.weight": self.config.num_attention_heads,
                 "self_attn.k_proj.weight": self.config.num_key_value_heads}.get(name.split(".", 3)[-1])
        if self.gguf.architecture == "llama" and heads:
            data = data[np.arange(len(data)).reshape(heads, -1, 2).transpose(0, 2, 1).reshape(-1)]
        return data

    def float32(self, name: str) -> np.ndarray:
        from dspark_export.checkpoint import as_float32

        return as_float32(*self.raw(name))

    def carried_layout(self, name: str) -> Layout | None:
        """The MatMulNBits layout that holds this matrix exactly (Q4_0, Q8_0, Q6_K; Q4_K and Q5_K but for the
        embedding, whose rows are gathered), or None."""
        kind = self.tensors[name].tensor_type.name
        if kind in OFFSET_TYPES and name in ("model.embed_tokens.weight", "lm_head.weight"):
            return None
        return CARRIED.get(kind)

    def rounds_activations(self, name: str) -> bool:
        """Whether llama.cpp rounds what this carried matrix multiplies to Q8_K (its K-quant products do), so the
        engine does too."""
        return self.tensors[name].tensor_type.name in ROUNDS_ACTIVATIONS

    def ggml_blocks(self, name: str) -> tuple[str, np.ndarray] | None:
        """A Q4_K, Q5_K or Q6_K matrix's type and blocks [rows, bytes per row] (rows in Hugging Face's order), for
        DSpark's operators that multiply them as ggml does (`k_quant_rows`); None for other types, or where this
        machine cannot build the operators (its engines carry K-quants into `MatMulNBits`, `carried`)."""
        kind = self.tensors[name].tensor_type.name
        if kind not in k_quant_rows.BLOCK_BYTES or not native.usable():
            return None
        return kind, self._rows(name)

    def k_quants(self) -> bool:
        """Whether every matrix goes to DSpark's K-quant operators (`ggml_blocks`), so that every product of a row
        is the same alone and in a batch."""
        matrices = [tensor for tensor in self.tensors.values() if len(tensor.shape) == 2]
        return native.usable() and all(tensor.tensor_type.name in k_quant_rows.BLOCK_BYTES for tensor in matrices)

    def carried(self, name: str) -> Carried | None:
        """This matrix's own codes and scales in MatMulNBits' layout, exact; None for a type it cannot hold.

        Q4_0: (q - 8)·d, GGUF's element j in the low and j + 16 in the high nibble, re-paired; Q8_0: q·d, a signed
        byte offset by 128; Q6_K: d·s·(q - 32) per 16 weights, a 6-bit q as an 8-bit code with zero point 32 and the
        scale d·s (exact in float32), its codes read back from the dequantized values."""
        layout = self.carried_layout(name)
        if layout is None:
            return None
        tensor = self.tensors[name]
        rows, kind = int(tensor.shape[1]), tensor.tensor_type.name
        data = self._rows(name)
        if kind == "Q6_K":
            return _q6_k(data, rows, self.raw(name)[0])
        if kind in OFFSET_TYPES:
            return _k_quant(data, rows, self.raw(name)[0], kind)
        blocks = data.reshape(rows, -1, 2 + CARRIED_BLOCK * layout.bits // 8)
        scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32)
        quants = blocks[..., 2:]
        if kind == "Q8_0":  # signed bytes -> unsigned codes around MatMulNBits' implicit zero point 128
            return Carried(quants ^ np.uint8(0x80), scales, None, layout)
        values = np.concatenate([quants & 0xF, quants >> 4], axis=-1)  # GGUF: element j low, j + 16 high nibble
        return Carried((values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8), scales, None, layout)

    def lm_head_name(self) -> str:
        return "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"


def quantization_report(checkpoint: GGUFCheckpoint, weights: WeightFormat) -> dict:
    """What `inspect` says of a GGUF target built in `weights`: its types per kind of matrix, which
    kinds the engine holds exactly (carried blocks, or float weights), and for the others the relative RMS error of
    re-quantizing them (measured on the first tensor of each kind)."""
    from dspark_export.graphs.weights import format_values

    gguf, exact, requantized = checkpoint.gguf, set(), {}
    for name, tensor in gguf.tensors.items():
        kind = name.split(".")[-2]
        if len(tensor.shape) != 2 or kind in exact or kind in requantized:
            continue
        if weights.bits is None or (weights.blocked and (checkpoint.carried_layout(name) or
                                                         checkpoint.ggml_blocks(name))):
            exact.add(kind)
            continue
        values = checkpoint.float32(name)
        error = format_values(values, weights) - values
        relative = float(np.sqrt((error**2).mean() / (values**2).mean()))
        if relative < EXACT:  # another grid that fits the format's (Q5_0 in int8)
            exact.add(kind)
        else:
            requantized[kind] = round(relative, 5)
    return {"file": str(gguf.file.resolve()), "main_type": gguf.main_type(), "weights": natural_weights(gguf),
            "types": gguf.quantization_mix(), "exact": sorted(exact), "requantized": requantized,
            "all_exact": not requantized,
            "requantized_error": max(requantized.values(), default=0.0)}
