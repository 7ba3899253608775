"""What a GGUF file must hold before DSpark makes anything of it, past the structure `gguf_reader` checks: the
hyperparameters its architecture needs, of the right types and in range (positive counts that divide as attention
needs, a finite positive rope theta and RMS epsilon), exactly the tensors those imply with the shapes they imply
(none missing, none extra, none of a type DSpark cannot read), and a tokenizer consistent with itself and with the
embedding (one string per embedding row, token types beside them, merges of known tokens, special ids inside the
vocabulary). Each failure is one `CheckpointError` naming the file, the field and what was expected."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from dspark_common.errors import CheckpointError
from dspark_export.gguf_reader import ARRAY, STRING

if TYPE_CHECKING:
    from dspark_export.gguf_target import GGUFFile

INTEGER, FLOAT = "integer", "float"  # kinds `GGUFFile.field` accepts beside a GGUF value type
LIMITS = {  # hyperparameter -> its largest sane value (a count beyond it would only exhaust memory)
    "block_count": 1024, "embedding_length": 1 << 17, "feed_forward_length": 1 << 19, "attention.head_count": 1024,
    "attention.head_count_kv": 1024, "attention.key_length": 4096, "attention.value_length": 4096,
    "context_length": 1 << 24,
}
REQUIRED = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count", "context_length")
VECTOR_TYPES = ("F32", "F16", "BF16")  # norms and biases
MATRIX_TYPES = VECTOR_TYPES + ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                                "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "IQ1_M",
                                "TQ1_0", "TQ2_0", "MXFP4")  # types the gguf package dequantizes
TOKEN_TYPES = range(0, 7)  # llama.cpp's: undefined, normal, unknown, control, user-defined, unused, byte
MAX_TEMPLATE = 1 << 20  # characters of a chat template


def check_file(gguf: GGUFFile) -> None:
    """The hyperparameters and the tensor set of `gguf` (its tokenizer: `check_tokenizer`)."""
    arch, name = gguf.architecture, gguf.file.name
    values = {}
    for key, limit in LIMITS.items():
        if key not in REQUIRED and not gguf.has(f"{arch}.{key}"):
            values[key] = 0  # absent: implied by the others
            continue
        value = gguf.field(f"{arch}.{key}", kind=INTEGER)
        if not 1 <= value <= limit:
            raise CheckpointError(f"{name}: {arch}.{key} is {value}, expected a count from 1 to {limit}")
        values[key] = value
    heads = values["attention.head_count"]
    kv_heads = values["attention.head_count_kv"] or heads
    if heads % kv_heads:
        raise CheckpointError(f"{name}: {arch}.attention.head_count_kv {kv_heads} does not divide head_count {heads}")
    if not values["attention.key_length"] and values["embedding_length"] % heads:
        raise CheckpointError(f"{name}: {arch}.embedding_length {values['embedding_length']} does not divide into "
                              f"{heads} heads (and no attention.key_length says the head size)")
    if values["attention.value_length"] and values["attention.value_length"] != (values["attention.key_length"]
                                                                                or values["embedding_length"] // heads):
        raise CheckpointError(f"{name}: {arch}.attention.value_length differs from the key length")
    for key, required in (("attention.layer_norm_rms_epsilon", True), ("rope.freq_base", False)):
        value = gguf.field(f"{arch}.{key}", None if required else 1.0, FLOAT)
        if not (math.isfinite(value) and value > 0) or key.endswith("epsilon") and value >= 1:
            raise CheckpointError(f"{name}: {arch}.{key} is {value}, expected a finite positive number"
                                  + (" below 1" if key.endswith("epsilon") else ""))
    if "model.embed_tokens.weight" not in gguf.tensors:
        raise CheckpointError(f"{name} lacks the tensor token_embd.weight")
    _check_tensors(gguf)


def _check_tensors(gguf: GGUFFile) -> None:
    """Exactly the tensors the hyperparameters imply, in shapes they imply and types DSpark reads."""
    from dspark_export.checkpoint import expected_shapes

    config = gguf.config()
    expected = expected_shapes(config)
    name = gguf.file.name
    missing = sorted(set(expected) - set(gguf.tensors))
    extra = sorted(set(gguf.tensors) - set(expected))
    if missing or extra:
        raise CheckpointError(f"{name}: its tensors are not those of a {gguf.architecture} with "
                              f"{config.num_hidden_layers} layers" + (f"; missing {missing[:3]}" if missing else "")
                              + (f"; not expected {extra[:3]}" if extra else ""))
    for hf_name, tensor in gguf.tensors.items():
        shape = tuple(int(n) for n in reversed(tensor.shape))
        if shape != expected[hf_name]:
            raise CheckpointError(f"{name}: {tensor.name} has shape {list(shape)}, expected {list(expected[hf_name])}")
        allowed = VECTOR_TYPES if len(shape) == 1 else MATRIX_TYPES
        if tensor.tensor_type.name not in allowed:
            raise CheckpointError(f"{name}: {tensor.name} is stored as {tensor.tensor_type.name}, which DSpark does "
                                  f"not read for a {'vector' if len(shape) == 1 else 'matrix'} "
                                  f"(it reads {', '.join(allowed[:8])}, ...)")


def check_tokenizer(gguf: GGUFFile) -> tuple[list[str], np.ndarray, list[tuple[str, str]]]:
    """The tokens, their types and the merges, checked against each other and the embedding's rows."""
    name, rows = gguf.file.name, int(gguf.tensors["model.embed_tokens.weight"].shape[1])
    tokens = gguf.field("tokenizer.ggml.tokens", kind=(ARRAY, STRING))
    if len(tokens) != rows:
        raise CheckpointError(f"{name}: tokenizer.ggml.tokens has {len(tokens)} tokens, the embedding {rows} rows")
    kinds = np.asarray(gguf.field("tokenizer.ggml.token_type", np.ones(rows, np.int64), (ARRAY, INTEGER)))
    if len(kinds) != rows or not np.isin(kinds, TOKEN_TYPES).all():
        raise CheckpointError(f"{name}: tokenizer.ggml.token_type has {len(kinds)} entries for {rows} tokens, or "
                              "types outside 0-6")
    used = [token for token, kind in zip(tokens, kinds) if kind != 5]
    if len(set(used)) != len(used):
        raise CheckpointError(f"{name}: tokenizer.ggml.tokens lists a token twice")
    known = set(used)
    merges = []
    for merge in gguf.field("tokenizer.ggml.merges", kind=(ARRAY, STRING)):
        parts = tuple(merge.split(" ", 1))
        if len(parts) != 2 or parts[0] not in known or parts[1] not in known or parts[0] + parts[1] not in known:
            raise CheckpointError(f"{name}: tokenizer.ggml.merges has {merge!r}, not a merge of two known tokens into "
                                  "a known one")
        merges.append(parts)
    for key in [k for k in gguf.contents.fields if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")]:
        value = gguf.field(key, kind=INTEGER)
        if not 0 <= value < rows:
            raise CheckpointError(f"{name}: {key} is {value}, outside the vocabulary's {rows} tokens")
    if gguf.has("tokenizer.chat_template") and len(gguf.field("tokenizer.chat_template", kind=STRING)) > MAX_TEMPLATE:
        raise CheckpointError(f"{name}: tokenizer.chat_template is over {MAX_TEMPLATE} characters")
    return tokens, kinds, merges

