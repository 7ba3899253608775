"""What `dspark-export inspect` reports: architecture, size and the memory a deployment needs."""

from __future__ import annotations

from typing import Any

from dspark_export.checkpoint import Checkpoint
from dspark_export.gguf_target import GGUFCheckpoint, quantization_report
from dspark_export.graphs.weights import WeightFormat
from dspark_export.presets import PRESETS, TargetSpec
from dspark_export.sizing import EngineSize


def describe_target(spec: TargetSpec, checkpoint: Checkpoint | GGUFCheckpoint | None, sizes: list[EngineSize],
                    dtype: str, candidates: list[WeightFormat]) -> dict[str, Any]:
    """Facts about a target, its `checkpoint` when found (opened, headers only, so that a broken one is reported here
    too) and the memory of an engine built from it in each candidate weight format (`sizes`, as `dspark-export build`
    sizes them; several where `--weights auto` chooses among them at build time)."""
    config, size, weights = spec.config, sizes[0], candidates[0]
    gguf = quantization_report(checkpoint, weights) if isinstance(checkpoint, GGUFCheckpoint) else None
    return {
        "target": spec.name,
        "hf_repo": PRESETS[spec.name][0] if spec.name in PRESETS else None,
        "weights": gguf["file"] if gguf else str(spec.path) if spec.path else None,
        "searched": [str(p) for p in spec.searched],
        "architecture": {
            "family": config.architecture.hf_class.removesuffix("ForCausalLM"),
            "layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "attention_heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "rope_theta": config.rope_theta,
            "rope_scaling": config.rope_type
            if config.rope_type == "default"
            else f"{config.rope_type} x{config.rope_factor:g}",
            "tie_word_embeddings": config.tie_word_embeddings,
            "max_position_embeddings": config.max_position_embeddings,
        },
        "vocab_size": config.vocab_size,
        "parameters": config.num_parameters(),
        "dtype": checkpoint.dtype if checkpoint else config.dtype,
        "gguf": gguf,
        "memory": {
            "dtype": dtype,
            "weights": weights.name,
            "quant_block_size": weights.block_size if weights.blocked else None,
            "format": str(weights),
            "slots": size.slots,
            "context": size.max_context,
            "weights_bytes": size.weight_bytes,
            "kv_cache_bytes": size.kv_bytes,
            "total_bytes": size.total_bytes,
            "line": size.line(),
            "auto": [{"weights": f.name, "format": str(f), "total_bytes": z.total_bytes, "line": z.line()}
                     for f, z in zip(candidates, sizes)] if len(candidates) > 1 else None,
        },
    }


def human_count(count: int) -> str:
    return f"{count / 1e9:.2f} B" if count >= 1e9 else f"{count / 1e6:.2f} M"


def format_report(report: dict[str, Any]) -> str:
    arch, memory = report["architecture"], report["memory"]
    weights = report["weights"] or "not found locally; looked in " + ", ".join(report["searched"])
    embeddings = "tied" if arch["tie_word_embeddings"] else "untied"
    rows = [
        ("target", report["target"] + (f" ({report['hf_repo']})" if report["hf_repo"] else "")),
        ("weights", weights),
        (
            "architecture",
            f"{arch['family']}, {arch['layers']} layers, hidden {arch['hidden_size']}, "
            f"FFN {arch['intermediate_size']}, {arch['attention_heads']} query / {arch['kv_heads']} KV heads "
            f"x {arch['head_dim']}",
        ),
        (
            "rope",
            f"theta {arch['rope_theta']:g}, scaling {arch['rope_scaling']}, "
            f"{arch['max_position_embeddings']} positions",
        ),
        ("embeddings", f"{embeddings}, vocabulary {report['vocab_size']}"),
        ("parameters", human_count(report["parameters"])),
        ("dtype", report["dtype"]),
        ("engine", f"{memory['dtype']} activations, {memory['format']}"),
        ("memory", memory["line"]),
    ]
    if memory["auto"]:
        rows[-2:] = [("engine", f"{memory['dtype']} activations; weights auto: the build times "
                                + " and ".join(c["weights"] for c in memory["auto"])
                                + " on this CPU and keeps the faster (--weights NAME chooses)")]
        rows += [(f"memory {c['weights']}", c["line"]) for c in memory["auto"]]
    gguf = report["gguf"]
    if gguf:
        rows[1:1] = [("gguf", f"mostly {gguf['main_type']} (an {gguf['weights']} engine by default); "
                              + "; ".join(f"{kind} {types}" for kind, types in gguf["types"].items()))]
        rows.append(("exact", ", ".join(gguf["exact"]) or "none"))
        if gguf["requantized"]:
            rows.append(("requantized", ", ".join(f"{kind} (RMS error {100 * error:.2f}%)"
                                                  for kind, error in gguf["requantized"].items())))
    return "\n".join(f"{name:<13}{value}" for name, value in rows)
