"""The sequential and confidence heads' share of one DSpark draft forward (paper: 0.2-1.3%).

    python scripts/head_share.py --drafter demo-dspark [--context 256] [--requests 1,8] [--repeats 50]

Times, in torch on this CPU, the parts of drafting γ tokens for R requests: the parallel part (feature
fusion, backbone over the gamma, LM head), the heads (γ sequential-head steps and the confidence head),
and sampling (the same for every drafter). Medians of `--repeats` runs, single-threaded for stable numbers.
"""

from __future__ import annotations

import argparse
import torch

from dspark_calibration.timing import median_seconds


def median_ms(fn, repeats: int) -> float:
    return 1e3 * median_seconds(fn, repeats)


@torch.no_grad()
def measure(drafter, context: int, requests: int, repeats: int) -> dict:
    from dspark_export.drafters.block_drafter import pick

    config, target = drafter.config, drafter.config.target_config
    gamma, hidden_size = config.gamma, target.hidden_size
    features = torch.randn(requests, context, hidden_size * len(config.feature_layers))
    ids = torch.full((requests, gamma), config.mask_token_id)
    positions = torch.arange(context, context + gamma).expand(requests, gamma)
    mask = torch.ones(requests, 1, gamma, context + gamma, dtype=torch.bool)
    context_positions = torch.arange(context).expand(requests, context)
    previous = torch.randint(4, target.vocab_size, (requests,))
    hidden = drafter.backbone(ids, positions, drafter.fuse(features), context_positions, mask)
    base = drafter.lm_head(hidden)
    noise = torch.rand(requests, gamma)

    def parallel():
        out = drafter.backbone(ids, positions, drafter.fuse(features), context_positions, mask)
        drafter.lm_head(out)

    def heads():
        state = None
        for k in range(gamma):
            _, code, state = drafter.markov_head.step(hidden[:, k], previous, state)
            drafter.confidence_logits(hidden[:, k], code)

    def sampling():
        for k in range(gamma):
            pick(base[:, k], 1.0, noise[:, k])

    parts = {"parallel_ms": median_ms(parallel, repeats), "heads_ms": median_ms(heads, repeats),
             "sampling_ms": median_ms(sampling, repeats)}
    total = sum(parts.values())
    return {"requests": requests, "context": context, **{k: round(v, 3) for k, v in parts.items()},
            "heads_share_of_draft": round(parts["heads_ms"] / total, 4),
            "heads_share_of_parallel_part": round(parts["heads_ms"] / parts["parallel_ms"], 4)}


def main() -> None:
    import json

    from dspark_export.loading import load_drafters, load_target
    from dspark_export.presets import resolve_target

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="demo-dspark")
    parser.add_argument("--target", default="demo")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--requests", default="1,8")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = resolve_target(args.target)
    model, tokenizer = load_target(spec)
    drafter = load_drafters(spec, model, tokenizer, [args.drafter])[args.drafter]
    if drafter.config.head == "none":
        raise SystemExit(f"{args.drafter} has no sequential head")
    for requests in (int(r) for r in args.requests.split(",")):
        print(
            json.dumps(
                {"drafter": args.drafter, "head": drafter.config.head}
                | measure(drafter, args.context, requests, args.repeats)
            )
        )


if __name__ == "__main__":
    main()
