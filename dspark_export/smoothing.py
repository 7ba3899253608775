"""SmoothQuant for `--weights w8a8` (`dspark-export build --smooth`): where a few input channels of a projection are
far larger than the rest (the massive activations of real Qwen3 and Llama checkpoints), one int8 scale per activation
row spends its range on them. Smoothing divides each input channel j by s_j = peak|X_j|^α / peak|W_:,j|^(1-α) and
multiplies the weights' column j by it, folded where it costs nothing at run time and changes no function:

- q/k/v (and gate/up): into the norm before them (its weight over s) and their columns (times s);
- down_proj: into up_proj's rows (silu(gate) · up is linear in up);
- o_proj: into v_proj's rows (and bias; attention is linear in v), one factor per value channel shared by the query
  heads of its group.

The activation peaks come from the fp32 torch model on calibration prompts (held apart from the benchmarks')."""

from __future__ import annotations

from typing import Callable

import numpy as np

from dspark_export.checkpoint import as_float32
from dspark_export.graphs.weights import Reader

ALPHA = 0.5  # SmoothQuant's migration strength
CALIBRATION_SKIP = 30  # the bundled prompts after the first 30 of each domain (benchmarks take the first ones)
CALIBRATION_PROMPTS = 8  # per domain
CALIBRATION_BATCH = 8  # prompts a forward


def activation_peaks(checkpoint, prompts: list[list[int]]) -> dict[str, np.ndarray]:
    """max |input| per channel of every projection (by its weight's name) over the prompts, from the torch model: the
    prompts sorted by length and right-padded into batches of `CALIBRATION_BATCH` (each streamed layer is read once a
    batch, with little padding to compute), the pads left out of the peaks (causal attention keeps them out of the
    real tokens)."""
    import torch

    from dspark_export.model import DecoderModel

    model = DecoderModel.from_checkpoint(checkpoint, "float32", streamed=True)
    peaks: dict[str, np.ndarray] = {}
    real = torch.ones(0, dtype=torch.bool)  # the current batch's real tokens, flattened

    def record(name: str) -> Callable:
        def hook(module, args) -> None:
            peak = args[0].detach().abs().reshape(-1, args[0].shape[-1])[real].amax(0).numpy()
            peaks[name] = np.maximum(peaks.get(name, peak), peak)
        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("layers."):
            module.register_forward_pre_hook(record(f"model.{name}.weight"))
    ordered = sorted(prompts, key=len)
    with torch.no_grad():
        for first in range(0, len(ordered), CALIBRATION_BATCH):
            batch = ordered[first:first + CALIBRATION_BATCH]
            longest = len(batch[-1])
            real = torch.tensor([[i < len(ids) for i in range(longest)] for ids in batch]).reshape(-1)
            model(torch.tensor([ids + [0] * (longest - len(ids)) for ids in batch]))
    return peaks


def smoothing_factors(peaks: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """s_j = peak|X_j|^α / peak|W_:,j|^(1-α) (1 where either is 0)."""
    factors = peaks.astype(np.float64) ** ALPHA / np.maximum(columns, 1e-12) ** (1 - ALPHA)
    factors[(peaks == 0) | (columns == 0)] = 1.0
    return factors


def smoothed_reader(read: Reader, config, peaks: dict[str, np.ndarray]) -> Reader:
    """`read` with every layer's norms, projections and v rows smoothed (see above), each tensor as it is read; the
    factors are worked out first from the peaks and the weights' column maxima."""
    kv, group, d = config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads, config.head_dim

    def columns(*names: str) -> np.ndarray:
        return np.max([np.abs(as_float32(*read(name))).max(0) for name in names], 0)

    scale: dict[str, tuple[np.ndarray | None, np.ndarray | None]] = {}  # name -> (times its columns, over its rows)
    for layer in range(config.num_hidden_layers):
        attn, mlp = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        qkv = [attn + f"{n}_proj.weight" for n in "qkv"]
        attention_in = smoothing_factors(peaks[qkv[0]], columns(*qkv))
        gate_up = [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
        mlp_in = smoothing_factors(peaks[gate_up[0]], columns(*gate_up))
        down = smoothing_factors(peaks[mlp + "down_proj.weight"], columns(mlp + "down_proj.weight"))
        per_query = smoothing_factors(peaks[attn + "o_proj.weight"], columns(attn + "o_proj.weight"))
        value = per_query.reshape(kv, group, d).max(1)  # one factor per value channel, shared by its query heads
        scale |= {f"model.layers.{layer}.input_layernorm.weight": (None, attention_in),
                  attn + "q_proj.weight": (attention_in, None), attn + "k_proj.weight": (attention_in, None),
                  attn + "v_proj.weight": (attention_in, value.reshape(-1)),
                  attn + "v_proj.bias": (None, value.reshape(-1)),
                  attn + "o_proj.weight": (np.repeat(value[:, None], group, 1).reshape(-1), None),
                  f"model.layers.{layer}.post_attention_layernorm.weight": (None, mlp_in),
                  mlp + "gate_proj.weight": (mlp_in, None), mlp + "up_proj.weight": (mlp_in, down),
                  mlp + "down_proj.weight": (down, None)}

    def smoothed(name: str) -> tuple[np.ndarray, str]:
        if name not in scale:
            return read(name)
        times, over = scale[name]
        array = as_float32(*read(name)).astype(np.float64)
        if times is not None:
            array = array * times
        if over is not None:
            array = array / (over[:, None] if array.ndim == 2 else over)
        return array.astype(np.float32), "float32"

    return smoothed


class SmoothedCheckpoint:
    """A checkpoint whose `raw` tensors are smoothed for w8a8 (`smoothed_reader`); all else is the checkpoint's."""

    def __init__(self, checkpoint, prompts: list[list[int]]):
        self._checkpoint = checkpoint
        self.raw = smoothed_reader(checkpoint.raw, checkpoint.config, activation_peaks(checkpoint, prompts))

    def __getattr__(self, name: str):
        return getattr(self._checkpoint, name)


def calibration_prompts(tokenizer) -> list[list[int]]:
    """The bundled prompts held apart for calibration, as token ids."""
    from dspark_common.prompts import demo_prompts_path, read_prompts

    rows = read_prompts(demo_prompts_path(), CALIBRATION_PROMPTS, skip=CALIBRATION_SKIP)
    return [tokenizer.encode(row["prompt"]) for row in rows]
