"""What a draft call costs against a target step at the sizes users deploy, and what speed-up that allows.

    python scripts/real_size_costs.py --target qwen3-0.6b --work build/real-size
    python scripts/real_size_costs.py --target qwen3-8b --draft-vocab 0,32768 --drafter-weights int8,int4

Random weights with the published shapes (`random_checkpoint.py`, written once into --work): the outputs are
meaningless, the costs are real. The drafter has DeepSeek's published proportions: 5 layers reading 5 target
layers, block 7, Markov rank 256, a confidence head with Markov features, the target's embedding and LM head. The
target is built once as an int4 engine (target only); each drafter variant (--draft-vocab N, 0 = the full
vocabulary, by the demo's token counts; --drafter-weights) is built as an engine builds it. Timed on --threads
threads, medians of interleaved rounds: the target step t(B) of one request with B = 1..8 new tokens after 256
cached positions, and one draft call (one request, 3 new context rows) greedy and at T=1. Prints one JSON line per
variant: the costs, draft / t(1), and the projected best speed-up of one request at per-position acceptance a,
max over K of τ_K · t(1) / (t_draft + t(K + 1)) with τ_K = (1 - a^(K+1)) / (1 - a).
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

SCRIPTS = Path(__file__).parent
sys.path.insert(0, str(SCRIPTS))
from head_share import draft_feeds  # noqa: E402
from random_checkpoint import write_shard  # noqa: E402


def random_drafter(target_dir: Path, out: Path, layers: int) -> Path:
    """A DSpark drafter at DeepSeek's published proportions (but `layers` layers) with random weights, in our
    layout."""
    if (out / "model.safetensors").is_file():
        return out
    import torch

    from dspark_export.config import DecoderConfig
    from dspark_export.drafters.checkpoint import build_drafter
    from dspark_export.drafters.config import DrafterConfig, default_feature_layers

    target = DecoderConfig.from_dir(target_dir)
    config = DrafterConfig(drafter_type="dspark", target=target.architecture_fields() | {"dtype": "bfloat16"},
                           vocab_hash=None, mask_token_id=3, num_layers=layers,
                           feature_layers=default_feature_layers(target.num_hidden_layers, layers), markov_rank=256)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in build_drafter(config).state_dict().items()
                  if name not in config.shared_names()}
    out.mkdir(parents=True, exist_ok=True)
    write_shard(out / "model.safetensors", shapes, np.random.default_rng(1))
    (out / "config.json").write_text(config.to_json())
    return out


def rounds_median(calls: dict[str, callable], rounds: int, repeats: int) -> dict[str, float]:
    """Median seconds of each call over interleaved rounds (each round: `repeats` calls, their median)."""
    import time

    samples = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(rounds):
        for name, call in calls.items():
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                call()
                times.append(time.perf_counter() - started)
            samples[name].append(float(np.median(times)))
    return {name: float(np.median(values)) for name, values in samples.items()}


def projected(t: dict[int, float], draft: float, a: float) -> tuple[float, int]:
    """The best speed-up over K = 1..7 of one request at per-position acceptance a, and its K."""
    best = max((sum(a ** i for i in range(k + 1)) * t[1] / (draft + t[k + 1]), k) for k in range(1, 8))
    return round(best[0], 3), best[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen3-0.6b")
    parser.add_argument("--work", type=Path, default=Path("build/real-size"))
    parser.add_argument("--draft-vocab", default="0,32768", help="comma-separated sizes; 0 = the full vocabulary")
    parser.add_argument("--drafter-weights", default="int8,int4")
    parser.add_argument("--layers", default="5", help="comma-separated drafter depths (5: DeepSeek's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import onnxruntime as ort

    from dspark_export.build import build_engine
    from dspark_export.checkpoint import Checkpoint
    from dspark_export.drafters.draft_vocab import DraftVocab, with_draft_vocab
    from dspark_export.graphs.drafter import build_drafter_onnx
    from dspark_export.graphs.weights import WeightFormat
    from dspark_export.interop import open_drafter
    from dspark_export.presets import demo_dir, resolve_target
    from dspark_runtime.backend import OrtRunner, share_thread_pool
    from dspark_runtime.batches import TargetBatch
    from dspark_common.engine_dir import read_manifest
    from dspark_common.tokenizer import ChatTokenizer

    checkpoint_dir = args.work / args.target
    if not (checkpoint_dir / "model.safetensors.index.json").is_file():
        subprocess.run([sys.executable, str(SCRIPTS / "random_checkpoint.py"), "--target", args.target, "--out",
                        str(checkpoint_dir)], check=True)
    spec = resolve_target(None, str(checkpoint_dir))
    checkpoint = Checkpoint(checkpoint_dir, spec.config)
    engine_dir = args.work / f"{args.target}-int4"
    if not (engine_dir / "manifest.json").is_file():
        build_engine(spec, engine_dir, weights=WeightFormat("int4"), cache_slots=1, max_context=512, force=True)
    sources = {layers: open_drafter(random_drafter(checkpoint_dir, args.work / f"{args.target}-drafter-{layers}",
                                                   layers), spec.config, checkpoint)
               for layers in (int(n) for n in args.layers.split(","))}

    share_thread_pool(args.threads)
    options = ort.SessionOptions()
    options.use_per_session_threads = False
    manifest = read_manifest(engine_dir)
    target = OrtRunner(engine_dir / "target.onnx", manifest.target_io(), args.threads, shared_pool=True)
    context, cache_len = 256, np.array([256])
    calls = {}
    for tokens in range(1, 9):
        batch = TargetBatch(np.full(tokens, 5), context + np.arange(tokens), np.zeros(tokens, np.int64), cache_len,
                            np.arange(tokens))
        calls[f"t{tokens}"] = lambda feeds=batch.feeds(target.io): target.run_feeds(feeds)
    variants = []
    tokenizer_size = ChatTokenizer.from_dir(checkpoint_dir).vocab_size
    for (layers, source), vocab, weights in itertools.product(sources.items(), map(int, args.draft_vocab.split(",")),
                                                              args.drafter_weights.split(",")):
        drafted = source if not vocab else with_draft_vocab(
            source, checkpoint, *DraftVocab(vocab, (demo_dir() / "token_counts.json",)).choose(
                spec.config.vocab_size, tokenizer_size))
        name = f"layers{layers}-vocab{vocab or spec.config.vocab_size}-{weights}"
        graph = build_drafter_onnx(drafted, checkpoint, args.work / name / "drafter.onnx", WeightFormat(weights),
                                   greedy_shortcut=True)
        session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        inputs = {i.name for i in session.get_inputs()}
        for temperature in (0.0, 1.0):
            feeds = draft_feeds(drafted.config, 1, context, 3, temperature)
            feeds = {key: value for key, value in feeds.items() if key in inputs}
            calls[f"{name}-T{temperature:g}"] = lambda s=session, f=feeds: s.run(None, f)
        variants.append(name)
    seconds = rounds_median(calls, args.rounds, args.repeats)
    t = {tokens: seconds[f"t{tokens}"] for tokens in range(1, 9)}
    for name in variants:
        greedy, sampled = seconds[f"{name}-T0"], seconds[f"{name}-T1"]
        row = {"target": args.target, "drafter": name, "t_ms": {k: round(1e3 * v, 2) for k, v in t.items()},
               "draft_ms_greedy": round(1e3 * greedy, 2), "draft_ms_t1": round(1e3 * sampled, 2),
               "draft_over_t1_greedy": round(greedy / t[1], 3), "draft_over_t1_sampled": round(sampled / t[1], 3)}
        for a in (0.7, 0.85):
            row[f"projected_greedy_a{a}"], row[f"best_k_a{a}"] = projected(t, greedy, a)
        row["free_drafter_a0.7"] = projected(t, 0.0, 0.7)[0]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
