"""Backends for tests of the step loop (`dspark_runtime.runner`): a pure-numpy target, and a recorder of a real
runner's outputs. Loaded like any backend: `Engine.load(folder, FakeBackend(...))`."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from dspark_common.engine_dir import Manifest
from dspark_common.graph_io import GraphIO
from dspark_runtime.runner import Backend, Batch, GraphRunner


class BigramTarget:
    """The target graph's contract served by a random bigram model: the logits after a token depend on that token
    alone (no attention, so the caches hold nothing). Each call takes `delay` seconds more (a slower model); the
    row after the token `poison` is NaN (a model whose numbers overflowed there), a token no other row emits."""

    def __init__(self, io: GraphIO, vocab: int, end_tokens: tuple[int, ...], delay: float = 0.0,
                 poison: int | None = None, seed: int = 0):
        self.io, self.delay = io, delay
        self.table = np.random.default_rng(seed).normal(0, 3, (vocab, vocab)).astype(np.float32)
        self.table[:, list(end_tokens)] = -1e4  # requests end by their budget
        if poison is not None:
            self.table[:, poison] = -np.inf
            self.table[poison] = np.nan
        self.width = next((t.shape[1] for t in io.outputs if t.name == "features"), 0)

    def run(self, batch: Batch) -> dict[str, np.ndarray]:
        feeds = batch.feeds(self.io)  # what the step loop must provide, as for any graph
        time.sleep(self.delay)
        outputs = {"logits": self.table[feeds["input_ids"][feeds["logit_index"]]]}
        if self.width:
            outputs["features"] = np.zeros((len(feeds["input_ids"]), self.width), np.float32)
        return outputs


class FakeBackend:
    """A target-only engine on `BigramTarget` (the engine directory's graphs are not opened)."""

    def __init__(self, delay: float = 0.0, poison: int | None = None):
        self.delay, self.poison = delay, poison

    def open(self, folder: Path, manifest: Manifest) -> tuple[GraphRunner, None]:
        return BigramTarget(manifest.target_io(), manifest.vocab_size, manifest.eos_token_ids, self.delay,
                            self.poison), None

    def machine(self) -> dict:
        return {"backend": "fake"}


class Recorded:
    """A runner that keeps every output of the runner it wraps."""

    def __init__(self, runner: GraphRunner):
        self.runner, self.io, self.outputs = runner, runner.io, []

    def run(self, batch: Batch) -> dict[str, np.ndarray]:
        self.outputs.append(self.runner.run(batch))
        return self.outputs[-1]


class RecordingDrafter:
    """`backend` with its drafter runner `Recorded` (as `self.drafter`, once opened)."""

    def __init__(self, backend: Backend):
        self.backend, self.drafter = backend, None

    def open(self, folder: Path, manifest: Manifest) -> tuple[GraphRunner, GraphRunner | None]:
        target, drafter = self.backend.open(folder, manifest)
        self.drafter = drafter and Recorded(drafter)
        return target, self.drafter

    def machine(self) -> dict:
        return self.backend.machine()
