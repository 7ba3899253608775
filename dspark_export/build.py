"""`dspark-export build`: a target (and optionally a drafter) -> an engine directory the runtime runs.

The directory is written under a temporary name beside the destination and renamed only when
complete (`staging.staged`), so an interrupted build never leaves a folder that looks valid.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from pathlib import Path

from tqdm import tqdm

from dspark_export.checkpoint import expected_shapes
from dspark_export.config import DTYPES, DecoderConfig
from dspark_export.drafters.config import DrafterConfig
from dspark_export.drafters.draft_vocab import COUNTS_FILE, DraftVocab, default_draft_vocab, with_draft_vocab
from dspark_export.graphs.drafter import build_drafter_onnx
from dspark_export.graphs.target import attention_for, build_target_onnx, own_products
from dspark_export.graphs.weights import FLOAT_WEIGHTS, WeightFormat, Weights, float_weights
from dspark_export.interop import open_drafter
from dspark_export.interop.source import DrafterSource
from dspark_export.presets import TargetSpec
from dspark_export.sizing import size_engine
from dspark_export.staging import staged
from dspark_export.weight_choice import Choice, choose_weights, cpu_format
from dspark_common.engine_dir import (
    DRAFTER_GRAPH,
    TARGET_GRAPH,
    TOKENIZER_FILES,
    Manifest,
    file_digest,
    weights_digest,
    write_manifest,
)
from dspark_common.engine_checks import ENGINE_BACKENDS
from dspark_common.errors import DSparkError
from dspark_common.native import operators_library
from dspark_common.tokenizer import ChatTokenizer

BACKENDS = ("auto", *ENGINE_BACKENDS)  # auto: TensorRT where it is installed and a GPU is there, else ONNX Runtime


def default_engine_dir(target_name: str, drafter_name: str | None) -> Path:
    """Engines live in the user cache ($DSPARK_HOME, else $XDG_CACHE_HOME/dspark, else ~/.cache/dspark), one folder
    per target/drafter pair."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"  # empty: unset
    root = Path(os.environ.get("DSPARK_HOME") or Path(cache) / "dspark") / "engines"
    return root / (target_name + (f"-{drafter_name}" if drafter_name else ""))


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise DSparkError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
    if backend == "trt":
        from dspark_export.trt_build import require_tensorrt

        require_tensorrt()
        return "trt"
    return "ort"  # "auto": the runtime runs ONNX Runtime engines; TensorRT is asked for by name


def check_options(config: DecoderConfig, backend: str, dtype: str, weights: WeightFormat,
                  drafter_weights: WeightFormat | None) -> None:
    """Refuse an unsupported combination, naming the option, before anything is written."""
    if dtype not in DTYPES:
        raise DSparkError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if dtype == "bfloat16" and backend == "ort":
        raise DSparkError("--dtype bfloat16 needs --backend trt: ONNX Runtime's CPU provider has no bfloat16 kernels "
                          "(use float16 or float32)")
    if weights.bits is None and FLOAT_WEIGHTS[weights.name] != dtype:
        raise DSparkError(f"--weights {weights.name} needs --dtype {FLOAT_WEIGHTS[weights.name]} (float weights are "
                          "stored in the activation precision)")
    for option, chosen in (("--weights", weights), ("--drafter-weights", drafter_weights)):
        if chosen is not None and chosen.bits and backend == "trt":
            raise DSparkError(f"{option} {chosen.name} needs --backend ort (TensorRT engines keep float weights)")
    if drafter_weights is not None and drafter_weights.bits is None and drafter_weights.name != "fp32":
        raise DSparkError(
            f"--drafter-weights {drafter_weights.name}: the drafter computes in float32; use fp32, int8, int4 or w8a8"
        )
    if (weights.per_channel or weights.int4_rows) and dtype != "float32":
        raise DSparkError(f"--weights {weights.name} computes in float32 between its integer products: use --dtype "
                          "float32")
    if weights.int4_rows:
        operators_library()  # its operators build on this machine, or one clear line says why not
    if weights.blocked:
        bad = [w for w in config.input_widths() if w % weights.block_size]
        if bad:
            raise DSparkError(f"--quant-block-size {weights.block_size} does not divide the input width {bad[0]}")


DRAFTER_BLOCK = 128  # a real-size drafter's quantization block (`default_drafter_weights`)
REAL_SIZE_HIDDEN = 1024  # every Qwen3, Qwen2.5 and Llama-3.x has at least this hidden size; the demo has less


def default_drafter_weights(backend: str, weights: WeightFormat, config: DecoderConfig) -> WeightFormat:
    """ONNX Runtime: the target's own format beside an int4, w8a8 or w4a8 target (a drafter call scores γ+1 rows, which
    w8a8's integer products take at nearly the price of one), else int4 at real size (an int8 target's: a Q5_K_M or
    Q8_0 file's; an 8-bit drafter read 2x the bytes and called 1.6x as long) and int8 below it; TensorRT: float32. At
    real size in blocks of 128 where they divide the widths: the drafter's numbers never touch losslessness (the
    target verifies every draft), and MatMulNBits is faster with them than with 32, while the target keeps the blocks
    under which ONNX Runtime computes a row alike alone and in a batch (`profiling.one_row_drift` checks)."""
    real = config.hidden_size >= REAL_SIZE_HIDDEN and not any(w % DRAFTER_BLOCK for w in config.input_widths())
    own = weights.name if weights.name in ("int4", "w8a8", "w4a8") else "int4" if real else "int8"
    name = "fp32" if backend != "ort" else own
    return WeightFormat(name, max(weights.block_size, DRAFTER_BLOCK) if real else weights.block_size,
                        weights.accuracy_level, weights.code_max)


CPU_DRAFT_BLOCK = 3  # drafts a real-size block drafter makes per round on ONNX Runtime (`with_gamma`)


def with_gamma(source: DrafterSource | None, gamma: int) -> DrafterSource:
    """`source` drafting `gamma` tokens a round. EAGLE-3 unrolls any number of steps; a block drafter (DSpark,
    DFlash) drafts from the first `gamma` rows of the block it was trained with, so at most its trained γ (recorded
    as `trained_gamma`): a shorter block attends over fewer mask rows, which lowers each draft's acceptance a little
    and cuts the call's products in proportion (on a CPU they are most of its cost)."""
    if source is None:
        raise DSparkError("--gamma sets how many tokens a drafter drafts a round; this build has no drafter")
    config = source.config
    if config.drafter_type != "eagle3":
        trained = config.extra.get("trained_gamma", config.gamma)
        if gamma > trained:
            raise DSparkError(f"--gamma {gamma}: this {config.drafter_type} drafter was trained on blocks of {trained} "
                              f"drafts and drafts at most that many a round (choose 1..{trained})")
        config = dataclasses.replace(config, extra={**config.extra, "trained_gamma": trained})
    return dataclasses.replace(source, config=dataclasses.replace(config, gamma=gamma))


def default_gamma(source: DrafterSource | None, backend: str, config: DecoderConfig) -> int | None:
    """The drafts a round of a build that names no --gamma: `CPU_DRAFT_BLOCK` for a block drafter of a real-size
    target on ONNX Runtime, whose call costs about one target step's products per 6 block rows on a CPU, and whose
    scheduler verifies 2 to 3 drafts on most steps there (docs/benchmarks.md); else the trained γ (None)."""
    if source is None or source.config.drafter_type == "eagle3" or backend != "ort":
        return None
    if config.hidden_size < REAL_SIZE_HIDDEN or source.config.gamma <= CPU_DRAFT_BLOCK:
        return None
    return CPU_DRAFT_BLOCK


def build_engine(spec: TargetSpec, out: Path, drafter_dir: Path | None = None, drafter_name: str | None = None, *,
                 backend: str = "auto", dtype: str = "float32", cache_slots: int = 8, max_context: int | None = None,
                 max_batch_tokens: int = 256, force: bool = False, show_progress: bool = True,
                 weights: WeightFormat | None = None, drafter_weights: WeightFormat | None = None,
                 kv_memory: int | None = None, gamma: int | None = None, draft_vocab: DraftVocab | None = None,
                 smooth: bool = False) -> Path:
    """Write the engine directory `out`; returns it. `weights` default to `auto_weights`' choice (measured on this
    CPU; the dtype's float for a small target; w8a8 with `smooth`); the drafter's to `default_drafter_weights`. The
    context defaults to what `kv_memory` holds. `gamma` is the drafts a round (`with_gamma`; default
    `default_gamma`); `draft_vocab` prunes the drafter's output to that many of the target's most frequent tokens
    (ONNX Runtime engines default to `draft_vocab.default_size` where the drafter's or target's folder holds token
    counts). `smooth` applies SmoothQuant
    to a w8a8 target (`dspark_export.smoothing`; needs torch)."""
    backend = resolve_backend(backend)
    check_options(spec.config, backend, dtype, weights or float_weights(dtype), drafter_weights)
    out = Path(out)
    if out.exists() and not force:
        raise DSparkError(f"{out} already exists; pass --force to replace it")
    folder = spec.require_path()
    checkpoint = spec.checkpoint()
    tokenizer = ChatTokenizer.from_dir(folder)
    source = _drafter_source(drafter_dir, spec, checkpoint, tokenizer, backend, gamma, draft_vocab)
    if weights is None:
        choice = auto_weights(spec.config, backend, dtype, source and source.config, smooth)
        weights, smooth = choice.weights, smooth or choice.weights.per_channel
        if show_progress or choice.steps:
            print(choice.line(), file=sys.stderr)
        check_options(spec.config, backend, dtype, weights, drafter_weights)
    drafter_weights = drafter_weights or default_drafter_weights(backend, weights, spec.config)
    if smooth and not weights.per_channel:
        raise DSparkError("--smooth smooths the activations w8a8 quantizes per row: use it with --weights w8a8")
    if smooth:
        from dspark_export.smoothing import SmoothedCheckpoint, calibration_prompts

        checkpoint = SmoothedCheckpoint(checkpoint, calibration_prompts(tokenizer))
        source = _drafter_source(drafter_dir, spec, checkpoint, tokenizer, backend, gamma, draft_vocab)
    drafter_config = source and source.config
    feature_layers = list(drafter_config.feature_layers) if drafter_config else []
    gamma = drafter_config.gamma if drafter_config else 0
    size = size_engine(spec.config, cache_slots, dtype, weights, gamma, max_context, kv_memory, checkpoint)
    lowering = "ort" if backend == "ort" else "portable"
    attention = attention_for(spec.config, lowering, own_products(weights, dtype, checkpoint))
    if show_progress:
        print(f"engine: {weights}, {dtype} activations; {size.line()}", file=sys.stderr)
        if source is None:
            print("target only: no drafter, so no speculation (--drafter DIR adds one)", file=sys.stderr)
        elif drafter_config.gamma < drafter_config.extra.get("trained_gamma", drafter_config.gamma):
            print(f"drafter: drafts {drafter_config.gamma} of its {drafter_config.extra['trained_gamma']}-token block "
                  f"a round (--gamma N chooses)", file=sys.stderr)
        if source is not None and drafter_config.draft_vocab_size:
            origin = drafter_config.extra.get("draft_vocab_source", "its d2t")
            print(f"drafter: drafts over {drafter_config.draft_vocab_size} of {spec.config.vocab_size} tokens "
                  f"({origin}; --draft-vocab {spec.config.vocab_size} keeps them all)", file=sys.stderr)
        if attention == "varlen" and lowering == "ort":
            print(f"note: GroupQueryAttention cannot serve head size {spec.config.head_dim}; "
                  "the target uses the portable attention op", file=sys.stderr)
    with staged(out) as staging:
        total = len(expected_shapes(spec.config))
        # a bar on a terminal only (None: tqdm's own test), not hundreds of carriage returns in a log
        with tqdm(total=total, desc="build target", unit="tensor", disable=None if show_progress else True) as bar:
            build_target_onnx(checkpoint, staging / TARGET_GRAPH, dtype, feature_layers, weights, lowering,
                              size.cache_rows, cache_slots == 1, progress=bar.update)
        if source is not None:  # ONNX Runtime's If branches may differ in shape: greedy calls skip distributions
            target_graph = Weights.lend_from(staging / TARGET_GRAPH, checkpoint.raw, dtype, weights)
            build_drafter_onnx(
                source, checkpoint, staging / DRAFTER_GRAPH, drafter_weights, backend == "ort", target_graph
            )
        for name in TOKENIZER_FILES + ("chat_template.jinja",):
            if (folder / name).is_file():
                shutil.copy(folder / name, staging / name)
        manifest = Manifest(
            target=spec.config.to_hf_dict(),
            target_name=spec.name,
            drafter=(drafter_config and _config_dict(drafter_config)),
            drafter_name=drafter_name,
            dtype=dtype,
            backend=backend,
            cache_slots=cache_slots,
            max_context=size.max_context,
            max_batch_tokens=max_batch_tokens,
            vocab_size=spec.config.vocab_size,
            eos_token_ids=list(tokenizer.eos_token_ids),
            feature_layers=feature_layers,
            weights=weights.name,
            drafter_weights=drafter_config and drafter_weights.name,
            attention=attention,
            sources=source_digests(folder, drafter_dir),
        )
        if backend == "trt":
            from dspark_export.trt_build import build_trt_engines

            build_trt_engines(staging, manifest)
        write_manifest(staging, manifest)
    return out


def _drafter_source(drafter_dir: Path | None, spec: TargetSpec, checkpoint, tokenizer: ChatTokenizer, backend: str,
                    gamma: int | None, draft_vocab: DraftVocab | None) -> DrafterSource | None:
    """The drafter in `drafter_dir` (None: no drafter) for the target's `checkpoint`, drafting `gamma` a round
    (default: `default_gamma`) and pruned to `draft_vocab` (by default on ONNX Runtime where token counts are found)."""
    source = None if drafter_dir is None else open_drafter(drafter_dir, spec.config, checkpoint, tokenizer)
    gamma = gamma or default_gamma(source, backend, spec.config)
    if gamma is not None:
        source = with_gamma(source, gamma)
    if draft_vocab is None and backend == "ort" and source is not None and source.config.draft_vocab_size is None:
        draft_vocab = default_draft_vocab(spec.config.vocab_size, (drafter_dir, spec.require_path()))
    if draft_vocab is not None:
        if source is None:
            raise DSparkError("--draft-vocab prunes a drafter's output layer; this build has no drafter")
        source = with_draft_vocab(source, checkpoint, *draft_vocab.choose(spec.config.vocab_size, tokenizer.vocab_size))
    return source


def auto_weights(config: DecoderConfig, backend: str, dtype: str, drafter: DrafterConfig | None,
                 smooth: bool = False) -> Choice:
    """The weights of a build that names none: w8a8 when asked to `smooth` (its option); else on ONNX Runtime the
    format `weight_choice.choose_weights` measures fastest on this CPU; on TensorRT, the dtype's float."""
    if smooth:
        return Choice(cpu_format("w8a8"), {}, {}, "--smooth smooths w8a8's activations")
    if backend != "ort":
        return Choice(float_weights(dtype), {}, {}, "TensorRT engines keep float weights")
    layers, rows, gamma = (drafter.num_layers, drafter.draft_vocab_size or config.vocab_size, drafter.gamma) \
        if drafter else (0, 0, 0)
    return choose_weights(config, dtype, layers, rows, gamma, os.cpu_count() or 1)


def source_digests(target_folder: Path, drafter_dir: Path | None) -> dict[str, str]:
    """What an engine was built from (weights, token counts, generation defaults), so that a cached engine of changed
    sources can be told apart (one an older exporter wrote has another `format_version`)."""
    sources = {"target": weights_digest(target_folder)}
    files = {"target_counts": target_folder / COUNTS_FILE, "generation_config": target_folder / "generation_config.json"}
    if drafter_dir is not None:
        sources["drafter"] = weights_digest(drafter_dir)
        files["drafter_counts"] = drafter_dir / COUNTS_FILE
    return sources | {name: file_digest(file) for name, file in files.items() if file.is_file()}


def _config_dict(config) -> dict:
    import json

    return json.loads(config.to_json())
