"""`dspark-run profile`: measure t_target(B) and t_draft(R) on this machine and write hardware_curve.json.

SPS(B; R) = 1 / (t_draft(R) + t_target(B)) then drives the `sync` and `async` schedulers. The target is
timed with B new tokens spread over min(B, S) requests, each with `context` cached positions, for every B a
decoding step can send (S requests x (γ + 1) tokens; every B up to 16, then every 8th, interpolated between);
the drafter with R requests, each bringing a few new context positions, and once with many more, for the cost
of each further position (what a drafter call pays to catch up after steps that did not draft). Every size is
timed in interleaved rounds with robust statistics (`dspark_calibration.timing`). The file records the machine
it was measured on (the backend's `machine()`), so that an engine moved to another machine, or run with another thread
count, is profiled again instead of scheduled from another machine's costs.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Callable

import numpy as np

from dspark_calibration.timing import cost_table, median_seconds
from dspark_runtime.batches import DraftBatch, DraftRequest, TargetBatch
from dspark_common.engine_dir import HARDWARE_CURVE, Manifest
from dspark_runtime.runner import GraphRunner
from dspark_runtime.scheduler import PROFILED_CONTEXT_ROWS


def target_sizes(limit: int, dense: int = 16, step: int = 8) -> list[int]:
    """Batch sizes whose target step is timed: every one up to `dense`, then every `step`-th and the last;
    the curve in between is interpolated (it is smooth there, and this keeps first-use profiling short)."""
    return sorted(set(range(1, min(dense, limit) + 1)) | set(range(dense, limit + 1, step)) | {limit})


def decode_tokens(manifest: Manifest) -> int:
    """The most tokens a decoding step sends: every slot's anchor and γ drafts (prefill chunks are not scheduled)."""
    return min(manifest.max_batch_tokens, manifest.cache_slots * (manifest.gamma + 1))


def target_batch(manifest: Manifest, tokens: int, context: int) -> TargetBatch:
    """A step of `tokens` new tokens spread over min(tokens, S) requests, each with `context` cached positions."""
    slots = manifest.cache_slots
    requests = min(tokens, slots)
    per_request = np.full(requests, tokens // requests)
    per_request[: tokens % requests] += 1
    cache_len = np.zeros(slots, dtype=np.int64)
    cache_len[:requests] = context
    return TargetBatch(np.full(tokens, 5), np.concatenate([context + np.arange(n) for n in per_request]),
                       np.repeat(np.arange(requests), per_request), cache_len, np.arange(tokens))


def draft_batch(drafter: GraphRunner, manifest: Manifest, requests: int, context: int,
                new_context: int = PROFILED_CONTEXT_ROWS, temperature: float = 1.0) -> DraftBatch:
    """A drafter call for `requests` requests, each bringing `new_context` positions after `context` cached ones,
    sampling at `temperature` (0: the all-greedy call, which skips the distributions)."""
    width = drafter.io.input("context_features").shape[1]
    cache_len = np.zeros(manifest.cache_slots, dtype=np.int64)
    cache_len[:requests] = context
    return DraftBatch(
        [
            DraftRequest(
                slot=slot,
                anchor=5,
                anchor_pos=context + new_context,
                context_start=context,
                features=np.zeros((new_context, width), np.float32),
                next_tokens=[5] * new_context,
                temperature=temperature,
                noise=np.full(manifest.gamma, 0.5),
            )
            for slot in range(requests)
        ],
        cache_len,
    )


DRIFT_TOKENS = 64  # the likeliest tokens whose logits `one_row_drift` compares
DRIFT_CONTEXT = 16  # the positions `profile` prefills before comparing


def one_row_drift(target: GraphRunner, manifest: Manifest, context: int) -> float:
    """How far the target's logits for a token computed alone differ from the same token's computed as the first
    row of a two-token step (largest absolute difference among the likeliest tokens; 0.0 where this CPU's kernels
    agree bit for bit), after `context` real positions prefilled in slot 0: caches holding no request's K/V make
    logits in the tens of thousands, where any difference is amplified. A plain decoding step runs one row and a
    verification step several: where they differ, greedy speculation can pick another token than `off` where two
    tokens nearly tie (ONNX Runtime's int4 kernels on AVX2 without VNNI)."""
    cache_len = np.zeros(manifest.cache_slots, dtype=np.int64)
    prompt = np.arange(context) % (manifest.vocab_size - 5) + 5
    target.run(TargetBatch(prompt, np.arange(context), np.zeros(context, np.int64), cache_len, np.array([context - 1])))
    cache_len[0] = context
    alone = target.run(target_batch(manifest, 1, context))["logits"][0]
    paired = target.run(TargetBatch(np.full(2, 5), context + np.arange(2), np.zeros(2, np.int64), cache_len,
                                    np.arange(2)))["logits"][0]
    likeliest = np.argsort(alone)[-DRIFT_TOKENS:]
    return float(np.abs(alone[likeliest].astype(np.float64) - paired[likeliest]).max())


def profile(target: GraphRunner, drafter: GraphRunner | None, manifest: Manifest, folder: Path, machine_record: dict,
            context: int = 256, rounds: int = 5, progress: Callable[[str, int], None] | None = None) -> dict:
    """Measure the tables (the target's; the drafter's in calls that sample and all-greedy ones) in `rounds`
    interleaved rounds on the engine's runners (their caches are overwritten: no request may hold a slot) and write
    `hardware_curve.json` into the engine directory, with `machine_record` (the backend's `machine()`) and the
    largest spread between rounds of each table."""
    context = min(context, manifest.max_context - manifest.max_batch_tokens - manifest.gamma - 1)
    context = max(context, 0)
    sizes = target_sizes(decode_tokens(manifest))
    timed = cost_table(sizes, lambda b: lambda: target.run(target_batch(manifest, b, context)), rounds,
                       progress=progress and (lambda n: progress("target", n)))
    draft_seconds = greedy_seconds = np.zeros(manifest.cache_slots)
    draft_spread, per_row = 0.0, 0.0
    if drafter is not None:
        def drafter_table(temperature: float):
            return cost_table(range(1, manifest.cache_slots + 1),
                              lambda r: lambda: drafter.run(draft_batch(drafter, manifest, r, context,
                                                                        temperature=temperature)),
                              rounds, progress=progress and (lambda n: progress("drafter", n)))

        # calls that sample, and all-greedy ones (they skip the distributions: cheaper, priced apart)
        sampled, greedy = drafter_table(1.0), drafter_table(0.0)
        draft_seconds, greedy_seconds = sampled.seconds, greedy.seconds
        draft_spread = float(max(sampled.spreads.max(), greedy.spreads.max()))
        # what each further new context position costs (a drafter call after plain steps reads them all)
        requests, extra = min(4, manifest.cache_slots), 32
        batch = draft_batch(drafter, manifest, requests, context, PROFILED_CONTEXT_ROWS + extra)
        long = median_seconds(lambda: drafter.run(batch), 3 * rounds)
        per_row = max(0.0, float(long - draft_seconds[requests - 1]) / (extra * requests))
    curve = {
        "target_seconds": [round(float(t), 7) for t in np.interp(np.arange(1, sizes[-1] + 1), sizes, timed.seconds)],
        "draft_seconds": [round(float(t), 7) for t in draft_seconds],
        "greedy_draft_seconds": [round(float(t), 7) for t in greedy_seconds],
        "draft_seconds_per_context_row": round(per_row, 9),
        "spread": {"target": round(float(timed.spreads.max()), 3), "drafter": round(draft_spread, 3)},
        "context": context,
        "rounds": rounds,
        "one_row_drift": one_row_drift(target, manifest, DRIFT_CONTEXT),
        "machine": machine_record,
        "measured": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    (folder / HARDWARE_CURVE).write_text(json.dumps(curve, indent=1) + "\n")
    return curve
