"""The default weight format of a CPU engine, chosen by measuring this machine (`dspark-export build`'s `--weights
auto`, the default for float checkpoints).

int4 (`MatMulNBits`) reads half w8a8's bytes and wins a one-token step, which is bound by memory; w8a8's integer
products cost little more for eight rows than for one, which is what verifying drafts needs, but how little depends
on the CPU (AMX, VNNI, or AVX2 summing pairs in int16); w4a8 (DSpark's own operators) reads int4's bytes and makes
integer products of them, the fastest on an AVX2 CPU in every mode (docs/benchmarks.md). So the build times a few
decoder layers of the target's shapes in each format (random weights, the ops `Weights.linear` emits for an engine)
at 1 to γ + 1 rows, prices a whole target step and a drafter call from them, and keeps the format whose best
verification width gives the most tokens a second at a sampling request's acceptance (`ACCEPTANCE`); without a
drafter, the faster one-token step.
Small targets (the demo, test models) keep float weights: they compute the checkpoint itself, with little memory
traffic to save."""

from __future__ import annotations

import importlib.util
import math
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from dspark_common.native import operators_library, usable
from dspark_export.config import DecoderConfig
from dspark_export.graphs.weights import ExternalData, WeightFormat, Weights, float_weights
from dspark_plugins.builder import GraphBuilder

AUTO = "auto"  # --weights auto
SMALL_TARGET_BYTES = 256 << 20  # float32 weights at most this big stay float (the demo, test models)
ACCEPTANCE = 0.6  # a draft token's chance to be accepted given the ones before it were, at T=1 (τ 2.25 at fixed:3
# on the grown 1.7B pair; greedy ~0.8): w8a8 is chosen where it pays even when speculation pays least
MARGIN = 1.05  # w8a8 (twice int4's bytes) is kept only when it predicts at least this much faster
PROBE_WEIGHTS = 1 << 28  # at least this many weights are timed, and twice the last-level cache's bytes
ROUNDS = 7  # timed runs per format and row count (medians)
CANDIDATES = ("int4", "w8a8", "w4a8")  # w4a8 where DSpark's operators build (an x86-64 CPU and a C compiler)


@dataclass(frozen=True)
class Choice:
    """The chosen format, the predicted tokens per second of each candidate (its best verification width's), and
    each candidate's predicted target step time by rows [s]."""

    weights: WeightFormat
    rates: dict[str, float]
    steps: dict[str, dict[int, float]]
    why: str = ""

    def line(self) -> str:
        """What was measured and chosen, for stderr."""
        if not self.steps:
            return f"weights auto: {self.weights.name} ({self.why})"
        times = "; ".join(f"{name} " + ", ".join(f"t({m}) {t * 1e3:.0f} ms" for m, t in sorted(steps.items()))
                          for name, steps in self.steps.items())
        other = next(name for name in self.rates if name != self.weights.name) if len(self.rates) > 1 else None
        versus = f", {self.rates[self.weights.name] / self.rates[other]:.2f}x {other}" if other else ""
        return (f"weights auto: {self.weights.name}{versus} predicted on this CPU (target steps measured at its "
                f"shapes: {times}{'; ' + self.why if self.why else ''}; dspark-export build --weights NAME chooses)")


def layer_weights(config: DecoderConfig) -> int:
    """Weights of one decoder layer's projections."""
    h, d = config.hidden_size, config.head_dim
    attention = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    return attention + 3 * h * config.intermediate_size


def auto_candidates(config: DecoderConfig, dtype: str) -> tuple[list[WeightFormat], str]:
    """The formats `--weights auto` chooses from, and why any was left out: the dtype's float alone for a small
    target or a build not in float32; else int4, w8a8 where torch is installed (real checkpoints need SmoothQuant,
    calibrated with the torch model) and w4a8 where DSpark's operators build."""
    if dtype != "float32":
        return [float_weights(dtype)], f"--dtype {dtype}: the quantized formats compute in float32"
    if 4 * config.num_parameters() <= SMALL_TARGET_BYTES:
        return [float_weights(dtype)], "a small target keeps its float weights"
    formats = [cpu_format(name) for name in CANDIDATES]
    formats = [f for f in formats if not (f.blocked and any(w % f.block_size for w in config.input_widths()))]
    why = []
    if importlib.util.find_spec("torch") is None:
        formats = [f for f in formats if not f.per_channel]
        why.append("w8a8 needs --smooth's calibration, which needs torch: pip install 'dspark[export]'")
    if not usable():
        formats = [f for f in formats if not f.int4_rows]
        why.append("w4a8's operators need an x86-64 CPU and a C compiler")
    return formats or [float_weights(dtype)], "; ".join(why)


def choose_weights(config: DecoderConfig, dtype: str, drafter_layers: int, draft_rows: int, gamma: int,
                   threads: int) -> Choice:
    """`--weights auto` for a float checkpoint on ONNX Runtime: of `auto_candidates`, the one that decodes fastest on
    this CPU. A drafter of `drafter_layers` layers and `draft_rows` output rows drafts `gamma` tokens a call (0: no
    drafter, plain decoding)."""
    candidates, why = auto_candidates(config, dtype)
    if len(candidates) == 1:
        return Choice(candidates[0], {}, {}, why or "the one candidate")
    rows = sorted({1, 2, 4, gamma + 1}) if gamma else [1]
    probed = probe(config, candidates, rows, threads)
    target = config.num_hidden_layers * layer_weights(config) + config.vocab_size * config.hidden_size
    call = drafter_layers * layer_weights(config) + draft_rows * config.hidden_size
    steps = {name: {m: per_weight[m] * target for m in rows} for name, per_weight in probed.items()}
    rates = {name: best_rate(steps[name], probed[name][rows[-1]] * call if gamma else 0.0, ACCEPTANCE)
             for name in probed}
    best = max(candidates, key=lambda f: rates[f.name] / (MARGIN if f.per_channel else 1.0))
    return Choice(best, rates, steps, why)


def best_rate(step: dict[int, float], draft_call: float, acceptance: float) -> float:
    """Tokens a second at the best verification width: τ(k) / (t(k + 1) + a drafter call), τ(k) = Σ_{i≤k} a^i."""
    return max((1 - acceptance ** m) / (1 - acceptance) / (t + (draft_call if m > 1 else 0.0))
               for m, t in step.items())


def probe(config: DecoderConfig, formats: list[WeightFormat], rows: list[int], threads: int,
          others: dict[str, Callable[[np.ndarray], object]] | None = None) -> dict[str, dict[int, float]]:
    """Seconds per weight of a chain of decoder layers at the target's shapes, per format and row count.
    `others`: more runners of the same chain (x [M, hidden] -> y), timed in the same rounds."""
    import onnxruntime as ort

    layers = probe_layers(config)
    inputs = {m: np.random.default_rng(m).standard_normal((m, config.hidden_size), dtype=np.float32) for m in rows}
    runners = dict(others or {})
    with tempfile.TemporaryDirectory(prefix="dspark-probe-") as scratch:
        for fmt in formats:
            options = ort.SessionOptions()
            options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
            options.add_session_config_entry("session.intra_op.allow_spinning", "1")  # as the runtime runs, but
            options.add_session_config_entry("session.force_spinning_stop", "1")  # idle threads yield to the other
            if fmt.int4_rows:
                options.register_custom_ops_library(str(operators_library()))
            graph = _probe_graph(config, fmt, layers, Path(scratch) / f"{fmt.name}.onnx")
            session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
            runners[fmt.name] = lambda x, session=session: session.run(None, {"x": x})
    times: dict[str, dict[int, list[float]]] = {name: {m: [] for m in rows} for name in runners}
    for round_ in range(ROUNDS + 1):  # the first round warms up; formats and row counts interleaved, so that a
        for name, run in runners.items():  # busy spell slows all alike
            for m in rows:
                start = time.perf_counter()
                run(inputs[m])
                if round_:
                    times[name][m].append(time.perf_counter() - start)
    weights = layers * layer_weights(config)
    return {name: {m: float(np.median(t)) / weights for m, t in by_rows.items()} for name, by_rows in times.items()}


def probe_layers(config: DecoderConfig) -> int:
    """Decoder layers timed: at least `PROBE_WEIGHTS` weights and twice the last-level cache, at most the target's."""
    return min(config.num_hidden_layers, math.ceil(max(PROBE_WEIGHTS, 2 * last_level_cache()) / layer_weights(config)))


def last_level_cache() -> int:
    """The largest CPU cache's bytes as Linux reports it (0 where it does not)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = index.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes, default=0)


def cpu_format(name: str, block_size: int = 32, accuracy_level: int = 4) -> WeightFormat:
    """Weight format `name` as this CPU computes it: w8a8's codes as its int8 kernel sums them exactly."""
    from dspark_common.cpu import int8_code_max

    return WeightFormat(name, block_size, accuracy_level, int8_code_max())


def _probe_graph(config: DecoderConfig, fmt: WeightFormat, layers: int, path: Path) -> Path:
    """`layers` decoder layers' projections (q/k/v, o, gate/up, down) with random weights, chained with residual
    adds, x [M, hidden] -> y: what a target step multiplies, without attention and norms (alike in every format)."""
    import onnx
    from onnx import TensorProto, helper

    from dspark_export.graphs.model_file import ORT_DOMAIN
    from dspark_plugins.onnx_function import opset_imports

    h, d = config.hidden_size, config.head_dim
    shapes = {"q": (config.num_attention_heads * d, h), "k": (config.num_key_value_heads * d, h),
              "v": (config.num_key_value_heads * d, h), "o": (h, config.num_attention_heads * d),
              "gate": (config.intermediate_size, h), "up": (config.intermediate_size, h),
              "down": (h, config.intermediate_size)}

    def read(name: str) -> tuple[np.ndarray, str]:
        rows, columns = shapes[name.split(".")[1]]
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        return rng.standard_normal((rows, columns), dtype=np.float32) / np.float32(math.sqrt(columns)), "float32"

    store = ExternalData(path)
    stream = Weights(read, store, "float32", fmt)
    b = GraphBuilder()
    x = "x"
    for layer in range(layers):
        name = lambda part: f"{layer}.{part}"  # noqa: E731
        qkv = stream.linear(b, x, [name("q"), name("k"), name("v")])
        queries = b.op("Slice", qkv, b.const([0]), b.const([shapes["q"][0]]), b.const([1]))
        x = b.op("Add", x, stream.linear(b, queries, name("o")))
        gate, up = stream.linear(b, x, name("gate")), stream.linear(b, x, name("up"))
        x = b.op("Add", x, stream.linear(b, b.op("Mul", gate, up), name("down")))
    b.op("Identity", x, name="y")
    store.close()
    graph = helper.make_graph(b.nodes, "dspark_weight_probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", h])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", h])],
                              initializer=list(stream.initializers.values()))
    model = helper.make_model(graph, opset_imports=opset_imports() + [helper.make_opsetid(ORT_DOMAIN, 1)])
    onnx.save_model(model, str(path))
    return path
