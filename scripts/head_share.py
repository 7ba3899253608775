"""The sequential and confidence heads' share of one DSpark draft call (paper: 0.2-1.3% of a draft forward).

    python scripts/head_share.py --drafter demo-dspark [--requests 1,8] [--context 256] [--new 4] [--repeats 50] \
        [--weights int4] [--draft-vocab 4096]

Builds the drafter's ONNX graph as an engine would (`--weights`, int8 by default; the CPU graph's greedy
shortcut) and the same graph with both heads removed (the DFlash graph over the same backbone), then times one
draft call of each for R requests, each with `--context` positions already cached and `--new` new context rows
(the accepted tokens of the last round), at T=0 and T=1. The heads' share is (with - without) / with. Medians of
`--repeats` calls on the engine's thread count.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np


def draft_feeds(config, requests: int, context: int, new: int, temperature: float) -> dict[str, np.ndarray]:
    target = config.target_config
    rng = np.random.default_rng(0)
    rows = requests * new
    shape = (requests, target.num_key_value_heads, context + new + config.block_rows, target.head_dim)
    width = target.hidden_size * len(config.feature_layers)
    caches = {f"past_{kind}_{layer}": np.zeros(shape, np.float32) for kind in ("key", "value")
              for layer in range(config.num_layers)}
    return caches | {
        "context_features": rng.standard_normal((rows, width)).astype(np.float32),
        "context_slot": np.repeat(np.arange(requests), new),
        "context_pos": np.tile(np.arange(context, context + new), requests),
        "anchor_ids": rng.integers(4, target.vocab_size, requests), "anchor_pos": np.full(requests, context + new),
        "request_slot": np.arange(requests), "cache_len": np.full(requests, context),
        "noise": rng.uniform(0, 1, (requests, config.gamma)).astype(np.float32),
        "temperature": np.full(requests, temperature, np.float32),
    }


def median_ms(session, feeds: dict, repeats: int) -> float:
    names = {i.name for i in session.get_inputs()}
    feeds = {k: v for k, v in feeds.items() if k in names}
    session.run(None, feeds)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - started)
    return 1e3 * float(np.median(times))


def main() -> None:
    import onnxruntime as ort

    from dspark_export.drafters.bundled import resolve_drafter
    from dspark_export.drafters.draft_vocab import DraftVocab, with_draft_vocab
    from dspark_export.graphs.drafter import build_drafter_onnx
    from dspark_export.graphs.weights import WeightFormat
    from dspark_export.interop import open_drafter
    from dspark_export.presets import resolve_target

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="demo-dspark")
    parser.add_argument("--target", default="demo")
    parser.add_argument("--weights", default="int8", choices=["fp32", "int8", "int4"])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--new", type=int, default=4)
    parser.add_argument("--requests", default="1,8")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft-vocab", type=int, default=None,
                        help="draft over this many tokens, by the target's token_counts.json (as CPU engines do)")
    args = parser.parse_args()
    spec = resolve_target(args.target)
    checkpoint = spec.checkpoint()
    source = open_drafter(resolve_drafter(args.drafter), spec.config, checkpoint)
    if args.draft_vocab:
        counts = (spec.require_path() / "token_counts.json",)
        source = with_draft_vocab(source, checkpoint, *DraftVocab(args.draft_vocab, counts).choose(
            spec.config.vocab_size, None))
    if source.config.head == "none" and not source.config.confidence:
        raise SystemExit(f"{args.drafter} has no heads")
    headless = replace(source, config=replace(source.config, drafter_type="dflash", head="none", confidence=False))
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    with tempfile.TemporaryDirectory() as work:
        weights = WeightFormat(args.weights)
        variants = (("with", source), ("without", headless))
        graphs = {name: build_drafter_onnx(s, checkpoint, Path(work) / name / "drafter.onnx", weights,
                                           greedy_shortcut=True) for name, s in variants}
        sessions = {name: ort.InferenceSession(str(graph), options) for name, graph in graphs.items()}
        for requests in (int(r) for r in args.requests.split(",")):
            for temperature in (0.0, 1.0):
                feeds = draft_feeds(source.config, requests, args.context, args.new, temperature)
                ms = {name: median_ms(session, feeds, args.repeats) for name, session in sessions.items()}
                print(json.dumps({"drafter": args.drafter, "head": source.config.head, "requests": requests,
                                  "temperature": temperature, "with_heads_ms": round(ms["with"], 3),
                                  "without_heads_ms": round(ms["without"], 3),
                                  "heads_share": round((ms["with"] - ms["without"]) / ms["with"], 4)}))


if __name__ == "__main__":
    main()
