"""`dspark-export`: inspect targets, train and evaluate drafters, convert them between layouts, build engines."""

from __future__ import annotations

import functools
import json

import click

from dspark_export.build import BACKENDS
from dspark_export.config import DTYPES
from dspark_export.graphs.weights import WEIGHT_FORMATS, WeightFormat
from dspark_export.weight_choice import AUTO, cpu_format
from dspark_export.presets import KNOWN_TARGETS
from dspark_export.sizing import DESKTOP_SLOTS
from dspark_common.cli_common import DSparkGroup, parse_size, prompt_options
from dspark_common.graph_io import DRAFTER_TYPES


def target_options(command):
    """`--target NAME` and `--target-path DIR|FILE.gguf`, shared by every command that loads a target."""
    command = click.option("--target-path", type=click.Path(path_type=str), default=None,
                           help="Hugging Face model folder (config.json + safetensors), a GGUF file, or a GGUF by "
                                "name where its tool keeps it (ollama:qwen3:8b, lmstudio:ORG/REPO, hf:ORG/REPO); "
                                "never downloaded.")(command)
    return click.option("--target", type=click.Choice(KNOWN_TARGETS), default=None,
                        help="Named architecture; weights from --target-path or the local Hugging Face cache.")(command)


def engine_options(command):
    """How an engine is sized and stored, shared by `build` and `inspect` so that both report the same memory."""
    options = [
        click.option(
            "--dtype",
            type=click.Choice(DTYPES),
            default="float32",
            show_default=True,
            help="Activation precision (float32 on CPU; bfloat16 needs --backend trt).",
        ),
        click.option(
            "--weights",
            type=click.Choice((AUTO, *WEIGHT_FORMATS)),
            default=None,
            help="Target weights: fp32/fp16/bf16 (the --dtype's), block-quantized int8/int4 (a GGUF target's "
                 "default: its own, Q4_0 and Q8_0 blocks carried over exactly), w8a8: int8 per output channel "
                 "with activations quantized per row, whose integer products make verifying several tokens cost "
                 "little more than one on a CPU (7-bit codes on x86 without VNNI), or w4a8: int4 in blocks of 32 "
                 "with activations quantized per row, through DSpark's own AVX2 operators (compiled once with the "
                 "system's C compiler): int4's bytes for a token alone, integer products for several. auto (the "
                 "default for other "
                 "checkpoints): on ONNX Runtime the build times int4, w8a8 and w4a8 at the target's shapes on this "
                 "CPU and keeps the fastest (w8a8 with --smooth, which needs torch); small targets keep fp32.",
        ),
        click.option(
            "--quant-block-size",
            type=click.IntRange(min=16),
            default=32,
            show_default=True,
            help="Weights per quantization block (int8, int4). ONNX Runtime computes a token alone and in a batch "
                 "alike with 32 on AVX-512 VNNI CPUs, at no size on AVX2 ones without VNNI (there, `dspark-run "
                 "--exact-greedy`; `dspark-run profile` checks): larger blocks are faster but can break greedy "
                 "identity between modes.",
        ),
        click.option(
            "--accuracy-level",
            type=click.IntRange(0, 4),
            default=4,
            show_default=True,
            help="int8/int4 compute: 4 quantizes activations to int8 (fast on CPUs), 0 dequantizes to float.",
        ),
        click.option(
            "--cache-slots", type=click.IntRange(min=1), default=DESKTOP_SLOTS, show_default=True,
            help="Concurrent requests (one chat at a time by default; a server for several users wants more)."
        ),
        click.option(
            "--max-context",
            type=click.IntRange(min=2),
            default=None,
            help="Tokens per request (default: what --kv-memory holds, at most the model's positions).",
        ),
        click.option(
            "--kv-memory", default="512MiB", show_default=True,
            help="KV cache budget that sizes the default context (at most the model's positions)."
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def draft_vocab_options(command):
    """`--draft-vocab N` and `--draft-vocab-counts FILE`; the command receives a `DraftVocab` (or None) as
    `draft_vocab`."""

    @functools.wraps(command)
    def with_draft_vocab(*args, draft_vocab, draft_vocab_counts, **kwargs):
        from pathlib import Path

        from dspark_export.drafters.draft_vocab import DraftVocab

        counts = tuple(Path(f) for f in draft_vocab_counts)
        chosen = DraftVocab(draft_vocab, counts) if draft_vocab or counts else None
        return command(*args, draft_vocab=chosen, **kwargs)

    options = [
        click.option("--draft-vocab", type=click.IntRange(min=1), default=None,
                     help="Draft over the N most frequent target tokens only (a smaller output layer and Markov head; "
                          "lossless either way). build: ONNX Runtime engines default to half the vocabulary (at most "
                          "32768) where the drafter's or target's folder holds token_counts.json."),
        click.option("--draft-vocab-counts", type=click.Path(dir_okay=False, exists=True), multiple=True,
                     help="Token frequencies for --draft-vocab (alone: its default size): distillation .npz files or a "
                          ".json of counts per token id (repeatable)."),
    ]
    for option in reversed(options):
        with_draft_vocab = option(with_draft_vocab)
    return with_draft_vocab


def weight_format(weights: str | None, block_size: int, accuracy_level: int = 4) -> WeightFormat | None:
    """--weights as this CPU computes it (`weight_choice.cpu_format`); None for auto (or none named): the build
    chooses (`build.auto_weights`)."""
    return None if weights in (None, AUTO) else cpu_format(weights, block_size, accuracy_level)


def weight_formats(text: str) -> list[str]:
    """A comma-separated list of fp32, int8, int4 (each once)."""
    names = [name.strip() for name in text.split(",")]
    bad = [name for name in names if name not in ("fp32", "int8", "int4")]
    if bad or len(set(names)) != len(names):
        raise click.BadParameter(f"{text!r}: name fp32, int8 or int4, each at most once", param_hint="--target-weights")
    return names


def default_to_demo(target: str | None, target_path: str | None) -> tuple[str | None, str | None]:
    """Commands that need weights use the bundled demo when no target is named."""
    return (target or (None if target_path else "demo")), target_path


@click.group(cls=DSparkGroup)
def main() -> None:
    """Build DSpark engines: Qwen3, Qwen2.5 and Llama-3 targets with trained drafters, for the DSpark runtime."""


@main.command()
@click.argument("path", required=False, metavar="[PATH]")
@target_options
@engine_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(path, target, target_path, dtype, weights, quant_block_size, accuracy_level, cache_slots, max_context,
            kv_memory, as_json) -> None:
    """Show a target's architecture, size and the memory of an engine built from it (as `build` would size it).
    PATH is short for --target-path.

    \b
    Examples:
      dspark-export inspect --target qwen3-8b --weights int4 --cache-slots 4 --max-context 8192
      dspark-export inspect ~/models/Qwen3-4B
      dspark-export inspect ~/models/qwen3-8b-q4_k_m.gguf
    """
    from dspark_export.inspect import describe_target, format_report
    from dspark_export.presets import resolve_target
    from dspark_export.sizing import size_engine
    from dspark_export.weight_choice import auto_candidates

    if path and target_path:
        raise click.UsageError("give the target's path once: PATH or --target-path")
    spec = resolve_target(target, path or target_path)
    fmt = weight_format(weights or spec.weights, quant_block_size)
    candidates = [fmt] if fmt else auto_candidates(spec.config, dtype)[0]
    checkpoint = spec.checkpoint() if spec.path is not None else None
    sizes = [size_engine(spec.config, cache_slots, dtype, candidate, max_context=max_context,
                         kv_memory=parse_size(kv_memory, "--kv-memory"), carrier=checkpoint) for candidate in candidates]
    report = describe_target(spec, checkpoint, sizes, dtype, candidates)
    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))


@main.command()
@target_options
@click.option("--drafter-type", type=click.Choice(DRAFTER_TYPES), default="dspark", show_default=True)
@click.option(
    "--head",
    type=click.Choice(["markov", "gated", "rnn"]),
    default="markov",
    show_default=True,
    help="DSpark's sequential head: the paper's Markov bias, DeepSpec's gated variant, or the RNN head.",
)
@click.option("--layers", type=click.IntRange(min=1), default=1, show_default=True, help="Drafter layers.")
@click.option("--gamma", type=click.IntRange(min=1), default=7, show_default=True, help="γ: draft tokens per round.")
@click.option(
    "--markov-rank", type=click.IntRange(min=1), default=None, help="Rank r of the Markov head (default by vocabulary)."
)
@click.option(
    "--feature-layers", default=None, help="Comma-separated target layers (default: evenly spaced from 1 to L-3)."
)
@click.option(
    "--data",
    type=click.Path(dir_okay=False, exists=True),
    required=True,
    multiple=True,
    help="Self-distillation .npz (repeat to train on several).",
)
@click.option("--out", type=click.Path(file_okay=False), required=True, help="Drafter folder to write.")
@click.option("--steps", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=8, show_default=True, help="Sequences per step.")
@click.option(
    "--anchors", type=click.IntRange(min=1), default=32, show_default=True, help="Anchor blocks per sequence."
)
@click.option("--lr", type=float, default=6e-4, show_default=True)
@click.option(
    "--until", type=click.IntRange(min=1), default=None, help="Stop at this step (resume later with the same command)."
)
@click.option(
    "--save-dtype",
    type=click.Choice(["float32", "bfloat16"]),
    default="float32",
    show_default=True,
    help="Precision of the written weights (the bundled drafters use bfloat16).",
)
@click.option(
    "--threads", type=click.IntRange(min=1), default=None, help="CPU threads (default: all cores; 1 lets runs share)."
)
@click.option(
    "--init", "init_from", default=None,
    help="Start from this drafter (folder or bundled name): its architecture and weights; the architecture options "
         "are ignored.",
)
@click.option(
    "--target-weights", default="fp32", show_default=True,
    help="Distil from the target at these weight formats, in turn (e.g. fp32,int4: the features and outputs of both "
         "engines the drafter will run beside).",
)
@draft_vocab_options
def train(
    target,
    target_path,
    drafter_type,
    head,
    layers,
    gamma,
    markov_rank,
    feature_layers,
    data,
    out,
    steps,
    batch,
    anchors,
    lr,
    until,
    save_dtype,
    threads,
    init_from,
    target_weights,
    draft_vocab,
) -> None:
    """Train a drafter against a frozen target (target features computed online; resumable).

    With --draft-vocab N the drafter drafts over the N most frequent tokens of --draft-vocab-counts (default: the
    generated tokens of the --data files).

    \b
    Example:
      dspark-export train --target demo --drafter-type dspark --data build/demo/distill.npz --out drafters/dspark
    The run folder OUT.run keeps checkpoints: rerun the same command to resume.
    """
    from pathlib import Path

    from dspark_export.drafters.recipe import DrafterShape, train_for_target
    from dspark_export.drafters.train import DrafterTrainConfig
    from dspark_export.presets import resolve_target

    spec = resolve_target(*default_to_demo(target, target_path))
    shape = DrafterShape(drafter_type, head, layers, gamma, markov_rank,
                         tuple(int(x) for x in feature_layers.split(",")) if feature_layers else None)
    written = train_for_target(spec, shape, tuple(map(Path, data)), Path(out),
                               DrafterTrainConfig(steps=steps, batch=batch, anchors=anchors, lr=lr),
                               init_from=init_from, target_weights=tuple(weight_formats(target_weights)),
                               draft_vocab=draft_vocab, save_dtype=save_dtype, threads=threads, until=until)
    if written:
        click.echo(f"drafter written to {out}")


@main.command("eval")
@target_options
@click.option(
    "--drafter", "drafters", multiple=True, required=True, help="Drafter folder or bundled name (repeatable)."
)
@prompt_options
@click.option("--temperature", type=click.FloatRange(min=0), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0: off.")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True)
@click.option(
    "--max-new", type=click.IntRange(min=1), default=128, show_default=True, help="Tokens generated per prompt."
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="PNG of per-position acceptance curves.")
@click.option("--target-weights", type=click.Choice(["fp32", "int8", "int4"]), default="fp32", show_default=True,
              help="The target's weights as an engine of that format holds them.")
@draft_vocab_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def evaluate_command(target, target_path, drafters, rows, temperature, top_k, top_p, max_new, seed, plot,
                     target_weights, draft_vocab, as_json) -> None:
    """Measure drafters offline: real drafting and the step loop's lossless rule on target generations.

    \b
    Example:
      dspark-export eval --target demo --drafter demo-dspark --drafter demo-dflash --temperature 1 --json
    """
    import json as json_module

    from tqdm import tqdm

    from dspark_common.sampling import SamplingParams
    from dspark_export.drafters.evaluate import evaluate, plot_acceptance
    from dspark_export.loading import load_drafters, load_target
    from dspark_export.presets import resolve_target

    spec = resolve_target(*default_to_demo(target, target_path))
    model, tokenizer = load_target(spec, weights=target_weights)
    loaded = load_drafters(spec, model, tokenizer, list(drafters), draft_vocab)
    results = []
    for name, drafter in loaded.items():
        with tqdm(total=len(rows), desc=f"eval {name}", unit="prompt", disable=as_json or None) as bar:
            params = SamplingParams(max_tokens=max_new, temperature=temperature, top_k=top_k, top_p=top_p)
            result = {"drafter": name} | evaluate(model, drafter, rows, tokenizer, params, seed, bar.update)
        results.append(result)
    if plot:
        plot_acceptance(results, plot)
    report = results[0] if len(results) == 1 else {"results": results}
    click.echo(json_module.dumps(without_nan(report), indent=None if as_json else 2))


def without_nan(value):
    """`value` with NaN (a figure nothing measured, e.g. acceptance at a position no draft reached) as null, so that
    the output is standard JSON."""
    if isinstance(value, dict):
        return {key: without_nan(item) for key, item in value.items()}
    if isinstance(value, list):
        return [without_nan(item) for item in value]
    return None if isinstance(value, float) and value != value else value


@main.command()
@target_options
@click.option(
    "--drafter", default=None, help="Drafter folder or bundled name (demo: demo-dspark if bundled); none = target only."
)
@click.option("--no-drafter", is_flag=True, help="Build a target-only engine even where a default drafter exists.")
@click.option(
    "--out", type=click.Path(file_okay=False), default=None, help="Engine directory (default: the user cache)."
)
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
              help="ort: ONNX graphs for ONNX Runtime. trt also writes TensorRT engines (needs a GPU and the [trt] "
                   "extra), which no DSpark runtime reads yet: dspark-run runs the ONNX graphs beside them.")
@engine_options
@click.option(
    "--drafter-weights",
    type=click.Choice(WEIGHT_FORMATS),
    default=None,
    help="Drafter weights (default on ONNX Runtime: the target's beside int4, w8a8 or w4a8 target weights, else int4 "
         "at real size and int8 below it; TensorRT: fp32).",
)
@click.option("--max-batch-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option(
    "--gamma", type=click.IntRange(min=1), default=None,
    help="Drafts per round: EAGLE-3 drafters unroll any number of steps; DSpark and DFlash drafters draft from the "
         "first N rows of their trained block, at most its γ (default: 3 for those on ONNX Runtime at real size, "
         "whose calls cost in proportion to the rows on a CPU; else the trained γ).",
)
@draft_vocab_options
@click.option("--smooth", is_flag=True,
              help="w8a8 (implied without --weights) with SmoothQuant, for checkpoints whose projections see a few "
                   "massive input channels (moves their range into the weights, folded into the norms and v/up rows; "
                   "calibrated with the torch model, which needs the [export] extra).")
@click.option("--force", is_flag=True, help="Replace an existing engine directory.")
def build(
    target,
    target_path,
    drafter,
    no_drafter,
    out,
    backend,
    dtype,
    weights,
    quant_block_size,
    accuracy_level,
    cache_slots,
    max_context,
    kv_memory,
    drafter_weights,
    max_batch_tokens,
    gamma,
    draft_vocab,
    smooth,
    force,
) -> None:
    """Build an engine directory (ONNX graphs, tokenizer, manifest) for the DSpark runtime.

    \b
    Examples:
      dspark-export build --target demo
      dspark-export build --target qwen3-8b --target-path ~/models/Qwen3-8B --drafter ./qwen3-8b-dspark --out engines/q8
      dspark-export build --drafter demo-dflash --draft-vocab 4096 --draft-vocab-counts data/demo-distill.npz
    """
    from pathlib import Path

    from dspark_export.build import build_engine, default_engine_dir
    from dspark_export.drafters.bundled import default_drafter, resolve_drafter
    from dspark_export.presets import resolve_target

    spec = resolve_target(*default_to_demo(target, target_path))
    if drafter is None and not no_drafter:
        drafter = default_drafter(spec.name)
    drafter_dir = None if no_drafter or drafter is None else resolve_drafter(drafter)
    drafter_name = None if drafter_dir is None else (drafter if drafter.startswith("demo-") else drafter_dir.name)
    out_dir = Path(out) if out else default_engine_dir(spec.name, drafter_name)
    engine = build_engine(
        spec,
        out_dir,
        drafter_dir,
        drafter_name,
        backend=backend,
        dtype=dtype,
        cache_slots=cache_slots,
        max_context=max_context,
        max_batch_tokens=max_batch_tokens,
        force=force,
        weights=weight_format(weights or spec.weights, quant_block_size, accuracy_level),
        drafter_weights=weight_format(drafter_weights, quant_block_size, accuracy_level),
        kv_memory=parse_size(kv_memory, "--kv-memory"),
        gamma=gamma,
        draft_vocab=draft_vocab,
        smooth=smooth,
    )
    click.echo(f"engine written to {engine}")


@main.command()
@click.argument("drafter")
@target_options
@click.option(
    "--to",
    "layout",
    type=click.Choice(["speculators", "deepspec"]),
    required=True,
    help="speculators: the layout vLLM loads; deepspec: DeepSeek's DeepSpec.",
)
@click.option(
    "--out", type=click.Path(file_okay=False), required=True, help="Folder to write (config.json, model.safetensors)."
)
@click.option("--force", is_flag=True, help="Replace an existing folder.")
def convert(drafter, target, target_path, layout, out, force) -> None:
    """Write DRAFTER (a folder, bundled name or cached repo id, in any layout `build` reads) in another engine's layout.

    \b
    Examples:
      dspark-export convert demo-dspark --target demo --to speculators --out demo-dspark-speculators
      dspark-export convert ./my-drafter --target qwen3-8b --to deepspec --out my-drafter-deepspec
    """
    from pathlib import Path

    from dspark_export.drafters.bundled import resolve_drafter
    from dspark_export.interop import open_drafter
    from dspark_export.interop.export import convert_drafter
    from dspark_export.presets import PRESETS, resolve_target
    from dspark_common.tokenizer import ChatTokenizer

    spec = resolve_target(*default_to_demo(target, target_path))
    checkpoint = spec.checkpoint()
    source = open_drafter(
        resolve_drafter(drafter), spec.config, checkpoint, ChatTokenizer.from_dir(spec.require_path())
    )
    verifier = PRESETS[spec.name][0] if spec.name in PRESETS else str(spec.require_path().resolve())
    click.echo(f"drafter written to {convert_drafter(source, checkpoint, layout, Path(out), verifier, force)}")
