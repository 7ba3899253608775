"""GGUF files of a Hugging Face Qwen3/Qwen2/Llama folder, written with the `gguf` package under llama.cpp's names and
metadata keys (as its `convert_hf_to_gguf.py` writes them: a Llama's q and k rows permuted per head, its llama3
rotary scaling as a `rope_freqs` tensor), every 2-D weight in one GGUF type."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(name: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    if name in globals_:
        return globals_[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{NAMES[module]}.{kind}"


def write_gguf(folder: Path, file: Path, qtype: str = "F32", architecture: str | None = None,
               embedding_type: str | None = None, pre_tokenizer: str = "gpt-2") -> Path:
    """`folder` (config.json, model.safetensors, tokenizer files) as one GGUF file of weight type `qtype` (the
    embedding in `embedding_type`, as llama-quantize keeps a tied embedding at Q8_0 or Q6_K; Q6_K by `q6_k`)."""
    import gguf
    from gguf.quants import quantize

    from dspark_export.checkpoint import Checkpoint
    from dspark_export.config import DecoderConfig

    config = json.loads((folder / "config.json").read_text())
    arch = architecture or config["model_type"]
    writer = gguf.GGUFWriter(str(file), arch)
    heads = config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_value_length(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    decoder = DecoderConfig.from_dir(folder)
    writer.add_rope_freq_base(decoder.rope_theta)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = dict(tokenizer["model"]["vocab"]) | {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    names = {index: token for token, index in vocab.items()}  # rows past the tokenizer's: llama.cpp's [PAD<i>] rows
    tokens = [names.get(index, f"[PAD{index}]") for index in range(config["vocab_size"])]
    special = {t["id"] for t in tokenizer["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 if i in names else 5 for i in range(len(tokens))])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tokenizer["model"]["merges"]])
    writer.add_eos_token_id(vocab[tokenizer_config["eos_token"]])
    writer.add_pad_token_id(vocab[tokenizer_config["pad_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer_config["chat_template"])
    checkpoint = Checkpoint(folder, decoder)
    if decoder.rope_type == "llama3":
        base = 1.0 / decoder.rope_theta ** (np.arange(0, decoder.head_dim, 2) / decoder.head_dim)
        writer.add_tensor("rope_freqs.weight", (base / decoder.inverse_frequencies()).astype(np.float32))
    for name in checkpoint.tensors:
        values = checkpoint.float32(name)
        heads = {"q_proj": decoder.num_attention_heads, "k_proj": decoder.num_key_value_heads}.get(name.split(".")[-2])
        if arch == "llama" and heads:  # convert_hf_to_gguf's LlamaModel.permute
            values = values.reshape(heads, 2, -1, values.shape[-1]).swapaxes(1, 2).reshape(values.shape)
        chosen = embedding_type if embedding_type and name == "model.embed_tokens.weight" else qtype
        if values.ndim == 2 and chosen != "F32":
            kind = gguf.GGMLQuantizationType[chosen]
            # the gguf package writes no K-quants
            data = q6_k(values) if chosen == "Q6_K" else k_quant(values, chosen) if chosen in ("Q4_K", "Q5_K") \
                else quantize(values, kind)
            writer.add_tensor(gguf_name(name), data, raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name(name), values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file


def q6_k_bytes(codes: np.ndarray, sub_scales: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Rows of Q6_K blocks as ggml lays them out (ql, qh, int8 scales, float16 d per 256 weights) from 6-bit
    codes [n, K], scales [n, K/16] and d [n, K/256]."""
    n, k = codes.shape
    q = codes.reshape(n, k // 256, 2, 4, 32)  # per half of a block: four runs of 32, as dequantize_row_q6_K reads
    ql = np.concatenate([(q[:, :, :, 0] & 15) | ((q[:, :, :, 2] & 15) << 4),
                         (q[:, :, :, 1] & 15) | ((q[:, :, :, 3] & 15) << 4)], axis=-1)  # [n, B, 2, 64]
    qh = (q[:, :, :, 0] >> 4) | ((q[:, :, :, 1] >> 4) << 2) | ((q[:, :, :, 2] >> 4) << 4) | ((q[:, :, :, 3] >> 4) << 6)
    blocks = np.concatenate([ql.reshape(n, -1, 128), qh.reshape(n, -1, 64),
                             sub_scales.astype(np.int8).view(np.uint8).reshape(n, -1, 16),
                             d.astype(np.float16).view(np.uint8).reshape(n, -1, 2)], axis=-1)
    return blocks.astype(np.uint8).reshape(n, -1)


def q6_k(values: np.ndarray) -> np.ndarray:
    """float32 rows [n, K] (K a multiple of 256) rounded to Q6_K's grid and laid out as its blocks: per run of 16
    weights an int8 scale of a float16 d per 256, 6-bit codes around 32."""
    n, k = values.shape
    runs = values.reshape(n, k // 16, 16)
    wanted = np.abs(runs).max(-1) / 31  # the scale each run would like
    d = (wanted.reshape(n, k // 256, 16).max(-1) / 127).astype(np.float16)
    per_run = np.repeat(d.astype(np.float32), 16, axis=1)
    sub_scales = np.rint(wanted / np.where(per_run > 0, per_run, 1)).clip(-128, 127)
    step = (per_run * sub_scales)[..., None]
    codes = (np.rint(runs / np.where(step > 0, step, 1)) + 32).clip(0, 63).astype(np.uint8)
    return q6_k_bytes(codes.reshape(n, k), sub_scales, d)


def k_quant(values: np.ndarray, kind: str) -> np.ndarray:
    """float32 rows [n, K] (K a multiple of 256) as Q4_K or Q5_K blocks, laid out as ggml's: per 32 weights a 6-bit
    scale and a 6-bit min of float16 d and dmin per 256, w = d·sc·q - dmin·m with q of 4 (5) bits."""
    top = 15 if kind == "Q4_K" else 31
    n, k = values.shape
    runs = values.reshape(n, k // 256, 8, 32)
    mins = np.maximum(0, -runs.min(-1))  # [n, B, 8]
    wanted = (runs.max(-1) + mins) / top
    d = (wanted.max(-1) / 63).astype(np.float16)
    dmin = (mins.max(-1) / 63).astype(np.float16)
    sc = np.rint(wanted / np.where(d > 0, d, 1).astype(np.float32)[..., None]).clip(0, 63).astype(np.uint8)
    m = np.rint(mins / np.where(dmin > 0, dmin, 1).astype(np.float32)[..., None]).clip(0, 63).astype(np.uint8)
    step = d.astype(np.float32)[..., None] * sc
    low = dmin.astype(np.float32)[..., None] * m
    q = np.rint((runs + low[..., None]) / np.where(step > 0, step, 1)[..., None]).clip(0, top).astype(np.uint8)
    packed = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)], axis=-1)  # [n, B, 12]
    chunks = q.reshape(n, k // 256, 4, 2, 32)  # four runs of 64: the first 32 in low nibbles, the next in high
    qs = ((chunks[:, :, :, 0] & 0xF) | ((chunks[:, :, :, 1] & 0xF) << 4)).reshape(n, k // 256, 128)
    parts = [d.view(np.uint8).reshape(n, -1, 2), dmin.view(np.uint8).reshape(n, -1, 2), packed]
    if kind == "Q5_K":  # the fifth bits: bit 2j of qh[l] for element l of run 2j, bit 2j + 1 for run 2j + 1
        high = (chunks >> 4).reshape(n, k // 256, 8, 32).astype(np.uint16) << np.arange(8, dtype=np.uint16)[:, None]
        parts.append(high.sum(axis=2).astype(np.uint8))
    return np.concatenate([*parts, qs], axis=-1).reshape(n, -1)
