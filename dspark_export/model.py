"""The decoder in torch (Qwen3, Qwen2.5, Llama-3.x by its config): the target model for training drafters and the
numerical oracle for export.

Read top-down: RMSNorm, rotary tables, attention (GQA; q/k-norm or q/k/v biases as the architecture has them),
SwiGLU MLP, decoder layer, KV cache, model. Weights load from a Hugging Face checkpoint by their own tensor names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dspark_export.checkpoint import Checkpoint
from dspark_export.config import DecoderConfig

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like the reference implementation, then scale in the input dtype.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_tables(config: DecoderConfig, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for absolute positions [B, T] -> [B, 1, T, D], computed in float32 from the config's frequencies."""
    inv_freq = torch.from_numpy(config.inverse_frequencies()).to(positions.device)
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE in the rotate-half convention of Hugging Face checkpoints."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class LayerCache(nn.Module):
    """Preallocated keys/values of one layer, `[B, Hkv, max_len, D]`, written at absolute positions."""

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("keys", torch.zeros(batch, kv_heads, max_len, head_dim, dtype=dtype), persistent=False)
        self.register_buffer("values", torch.zeros(batch, kv_heads, max_len, head_dim, dtype=dtype), persistent=False)

    def update(self, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        # positions: [T] shared by the batch; keys/values: [B, Hkv, T, D]
        self.keys[:, :, positions] = keys
        self.values[:, :, positions] = values
        end = int(positions.max()) + 1
        return self.keys[:, :, :end], self.values[:, :, :end]


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        d, self.heads, self.kv_heads = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = d
        bias = config.qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, config.hidden_size, bias=False)
        norm = (lambda: RMSNorm(d, config.rms_norm_eps)) if config.qk_norm else nn.Identity
        self.q_norm, self.k_norm = norm(), norm()

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [B, T, H] -> rotated k [B, Hkv, T, D] and v [B, Hkv, T, D]."""
        batch, length, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, cos, sin), v

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [B, T, H] -> rotated q [B, Hq, T, D], k [B, Hkv, T, D] and v [B, Hkv, T, D]."""
        batch, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, length, self.heads, self.head_dim)).transpose(1, 2)
        return (rotate(q, cos, sin), *self.keys_values(x, cos, sin))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [B, Hq, T, D] over k, v [B, Hkv, S, D]; mask [.., T, S] bool (True = may attend) or None = causal."""
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))

    def forward(self, x, cos, sin, positions: torch.Tensor, cache: LayerCache | None) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        if cache is None:
            return self.attend(q, k, v, None)
        step_positions = positions[0]  # the batch shares positions when decoding with a cache
        k, v = cache.update(step_positions, k, v)
        mask = torch.arange(k.shape[2], device=x.device)[None, :] <= step_positions[:, None]  # [T, S]
        return self.attend(q, k, v, mask)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, cos, sin, positions, cache: LayerCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # [B, T, V]
    features: dict[int, torch.Tensor] = field(default_factory=dict)  # layer id -> [B, T, H]


class DecoderModel(nn.Module):
    """A causal LM. Module names mirror the Hugging Face checkpoint's tensor names."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.caches: nn.ModuleList | None = None

    def setup_caches(self, batch: int, max_len: int) -> None:
        """Preallocate a KV cache of `max_len` positions for `batch` sequences (once, before decoding)."""
        c, dtype = self.config, self.embed_tokens.weight.dtype
        self.caches = nn.ModuleList(
            LayerCache(batch, c.num_key_value_heads, max_len, c.head_dim, dtype) for _ in range(c.num_hidden_layers)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        feature_layers: Sequence[int] = (),
        use_cache: bool = False,
        logits: bool = True,
    ) -> TargetOutput:
        """input_ids [B, T]; positions [B, T] (default 0..T-1). Feature layer l is Hugging Face's
        `hidden_states[l + 1]`: the output of decoder layer l (the last one after the final norm), -1 the embeddings.

        With `use_cache`, keys/values are written to the preallocated caches at `positions` and attention
        reads every cached position up to each token's own.
        """
        if use_cache and self.caches is None:
            raise RuntimeError("call setup_caches() before decoding with use_cache=True")
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.embed_tokens(input_ids)
        cos, sin = rope_tables(self.config, positions, x.dtype)
        features = {-1: x} if -1 in feature_layers else {}
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, positions, self.caches[index] if use_cache else None)
            if index in feature_layers:  # Hugging Face's hidden_states[index + 1]: the last one after the norm
                features[index] = self.norm(x) if index == len(self.layers) - 1 else x
        return TargetOutput(self.lm_head(self.norm(x)) if logits else None, features)

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, dtype: str | None = None, streamed: bool = False,
                        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                        stream_head: bool = False) -> "DecoderModel":
        """Build the model and fill it from a checkpoint, in `dtype` (default: the checkpoint's own), each tensor
        passed through `transform` if given. `streamed` keeps only the embedding, the final norm and the LM head in
        memory and reads each decoder layer (and with `stream_head` an untied LM head too) from the checkpoint just
        before it runs, dropping it after: the same numbers in a fraction of the memory (an inference-only model:
        what it streams holds no parameters between calls)."""
        torch_dtype = TORCH_DTYPES[dtype or checkpoint.dtype]
        with torch.device("meta"):
            model = cls(checkpoint.config)

        def state(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
            tensors = {}
            for name in module.state_dict():
                full = prefix + name
                source = checkpoint.lm_head_name() if full == "lm_head.weight" else "model." + full
                tensor = to_torch(*checkpoint.raw(source)).to(torch_dtype)
                tensors[name] = transform(tensor) if transform else tensor
            return tensors

        def load(module: nn.Module, prefix: str) -> None:
            module.load_state_dict(state(module, prefix), assign=True)

        def drop(module: nn.Module, args, output) -> None:
            module.to_empty(device="meta")

        if streamed:
            streams = {f"layers.{index}.": layer for index, layer in enumerate(model.layers)}
            if stream_head and not checkpoint.config.tie_word_embeddings:
                streams["lm_head."] = model.lm_head
            for name in ("embed_tokens", "norm", "lm_head"):
                if name + "." not in streams:
                    load(getattr(model, name), name + ".")
            for prefix, module in streams.items():
                module.register_forward_pre_hook(lambda module, args, prefix=prefix: load(module, prefix))
                module.register_forward_hook(drop)
        else:
            load(model, "")
        if checkpoint.config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return model.eval()


def to_torch(array: np.ndarray, dtype: str) -> torch.Tensor:
    """A checkpoint tensor as a torch tensor of its own dtype (bfloat16 bits reinterpreted, not converted)."""
    if dtype == "bfloat16":
        return torch.from_numpy(np.array(array).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(array))


def save_checkpoint(model: DecoderModel, folder, dtype: str = "bfloat16", max_shard_bytes: int | None = None) -> None:
    """Write `config.json` and `model.safetensors` (or shards plus an index) in Hugging Face layout."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config.with_dtype(dtype)
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    state = {
        ("model." + name if not name.startswith("lm_head") else name): tensor.detach()
        .to(TORCH_DTYPES[dtype])
        .contiguous()
        for name, tensor in model.state_dict().items()
        if not (name == "lm_head.weight" and config.tie_word_embeddings)
    }
    if max_shard_bytes is None:
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    for name, tensor in state.items():
        if shards[-1] and sum(t.nbytes for t in shards[-1].values()) + tensor.nbytes > max_shard_bytes:
            shards.append({})
        shards[-1][name] = tensor
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    index = {"metadata": {"total_size": sum(t.nbytes for t in state.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
