"""The public runtime: `Engine.load(folder)`, then `generate`, `stream`, `chat`, from any number of threads.

One background thread owns the `EngineCore` and steps it while there is work; requests submitted
from other threads are batched into the same steps.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from dspark_runtime.core import EngineCore
from dspark_runtime.backend import OrtBackend
from dspark_common.engine_dir import (
    HARDWARE_CURVE,
    TARGET_GRAPH,
    Manifest,
    read_calibration,
    read_manifest,
    read_speed_curve,
    sts_by_temperature,
)
from dspark_common.engine_checks import REBUILD
from dspark_common.native import uses_operators
from dspark_common.errors import DSparkError, EngineError, InvalidRequestError, read_json_file
from dspark_runtime.output import Delta, OutputState
from dspark_common.randomness import KeyedRandom
from dspark_runtime.runner import Backend, GraphRunner
from dspark_common.sampling import SamplingParams
from dspark_runtime.logprobs import TokenLogprob
from dspark_runtime.scheduler import SpeedCurve
from dspark_runtime.sequence import RequestStats, Sequence
from dspark_runtime.spec_mode import SpecMode
from dspark_common.tokenizer import ChatTokenizer, TokenizerError, chat_messages, checked_text

Prompt = str | list[int] | list[dict[str, Any]]


QUICK_PROFILE_ROUNDS = 3  # on load: a few seconds for the demo (`dspark-run profile` takes 5 rounds)
# weight formats whose engines run every step in pairs unless told otherwise: their row products are exact integers,
# so pairing only removes attention's lone-row path, and a second row costs a plain step 0-10% on w8a8, 5-20% on w4a8
# (docs/benchmarks.md); so do engines whose target multiplies on DSpark's operators (a GGUF file's K-quants: 6%), but
# for those whose attention is DSpark's too (manifest attention "cached"), where a lone row computes as in a batch
EXACT_BY_DEFAULT = ("w8a8", "w4a8")

@dataclass(frozen=True)
class Completion:
    """A finished request, as the step loop recorded it when it ended."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length", "cancelled" or "error"
    prompt_tokens: int
    completion_tokens: int  # what the request generated, an end token included (what usage counts)
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them


class Request:
    """A submitted request: iterate it for deltas, `result()` for the whole completion, `cancel()` to stop. A
    request submitted with `stream=False` gets one delta, at its end. Iterating again, from any thread, replays
    the deltas from the first; `result()` may be called any number of times. What the step loop works on stays
    inside the engine: a request carries its deltas, and the `Completion` the loop made when it ended."""

    def __init__(self, engine: "Engine", sequence: Sequence, output: OutputState, stream: bool = True):
        self.engine, self._sequence, self.output, self.stream = engine, sequence, output, stream
        self.id, self.params, self.prompt_tokens = sequence.request_id, sequence.params, len(sequence.prompt)
        self.dropped_tokens = 0  # the prompt's first tokens left out to fit the context (`truncate=True`)
        self.verifications_sent = 0  # of the sequence's verifications, those its deltas carried
        self.completion: Completion | None = None  # set by the step loop as the request ends
        self._changed = threading.Condition()
        self._deltas: list[Delta] = []
        self._error: Exception | None = None
        self._listeners: list[Callable[[], None]] = []

    @property
    def finish_reason(self) -> str | None:
        """Why the request ended, None while it runs."""
        return self.completion and self.completion.finish_reason

    @property
    def done(self) -> bool:
        return self._error is not None or bool(self._deltas and self._deltas[-1].finish_reason)

    def cancel(self) -> None:
        self.engine.cancel(self.id)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request has ended (or `timeout` seconds passed); whether it has."""
        with self._changed:
            return self._changed.wait_for(lambda: self.done, timeout)

    def listen(self, callback: Callable[[], None]) -> None:
        """Call `callback()` (from the step loop's thread, so keep it short) whenever a delta or the end arrives:
        an event loop can wait for a request without holding a thread."""
        with self._changed:
            self._listeners.append(callback)

    def deltas_from(self, index: int) -> tuple[list[Delta], bool]:
        """Without waiting: the deltas from `index` on and whether the request has ended; once every delta of a
        request that failed has been read, its error is raised."""
        with self._changed:
            if self._error is not None and index >= len(self._deltas):
                raise self._error
            return self._deltas[index:], self.done

    def _deliver(self, event: Delta | Exception) -> None:
        """The step loop's side: one more delta, or the error that ended the request."""
        with self._changed:
            if isinstance(event, Exception):
                self._error = event
            else:
                self._deltas.append(event)
            self._changed.notify_all()
            listeners = list(self._listeners)
        for callback in listeners:
            callback()

    def __iter__(self) -> Iterator[Delta]:
        index = 0
        while True:
            with self._changed:
                self._changed.wait_for(lambda: index < len(self._deltas) or self.done)
                if index == len(self._deltas):
                    if self._error is not None:
                        raise self._error
                    return
                delta = self._deltas[index]
            index += 1
            yield delta

    def result(self) -> Completion:
        """The whole completion, once the request has ended (its error raised, if it failed)."""
        for _ in self:
            pass
        return self.completion

    def _end(self, sequence: Sequence) -> None:
        """The step loop's side: record the completion of a request that has just ended."""
        logprobs = None if sequence.params.logprobs is None else sequence.logprobs[: len(self.output.visible)]
        generated = len(sequence.generated)
        self.completion = Completion(self.output.sent_text, list(self.output.visible), sequence.finish_reason,
                                     self.prompt_tokens, generated, sequence.stats.summary(generated), logprobs)


class Engine:
    """A loaded engine directory: tokenizer, graphs, caches and the step loop."""

    def __init__(
        self,
        folder: Path,
        manifest: Manifest,
        tokenizer: ChatTokenizer,
        target: GraphRunner,
        drafter: GraphRunner | None,
        curve: SpeedCurve | None = None,
        calibration: dict[float, dict] | None = None,
        machine: dict | None = None,
        exact_greedy: bool = False,
    ):
        self.folder, self.manifest, self.tokenizer, self.exact_greedy = folder, manifest, tokenizer, exact_greedy
        self.machine = machine or {}  # what the speed curve is measured on (the backend's `machine()`)
        self.core = EngineCore(manifest, target, drafter, curve, sts_by_temperature(calibration or {}) or None,
                               2 if exact_greedy else 1)
        self._ids = count()
        self._requests: dict[int, Request] = {}
        self._inbox: list[Sequence] = []
        self._changes: list[Callable[[EngineCore], None]] = []  # from callers, applied by the loop between steps
        self._exclusive: list[Callable[[EngineCore], None]] = []  # run by the loop when no request holds a slot
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="dspark-engine", daemon=True)
        self._thread.start()

    @classmethod
    def load(cls, path: str | Path, backend: Backend | None = None, profile: bool = True,
             exact_greedy: bool | None = None) -> "Engine":
        """Load an engine directory (`dspark_export.demo_engine()` is the bundled demo's) onto `backend` (default:
        ONNX Runtime on every core, `OrtBackend`).

        An engine with a drafter but no hardware_curve.json, or one measured on another machine or with another
        thread count, is profiled first, announced by a line on stderr (`profile=False` skips it: then `sync`/`async`
        are unavailable without a curve, and a line warns about a curve from elsewhere).

        `exact_greedy`: every step runs an even number of rows, so that a plain step computes as a verification step
        does and greedy output is the same in every mode even where this CPU computes a lone row with other kernels
        (`dspark-run profile` reports it: ONNX Runtime's attention everywhere, its int4 kernels on AVX2 without VNNI
        at every block size and with AVX-512 VNNI in blocks of 64 or more): plain steps then cost what two-token
        steps cost (docs/benchmarks.md has the figure). None (the default) turns it on for w8a8 and w4a8 engines
        (`EXACT_BY_DEFAULT`) and targets on DSpark's operators (GGUF K-quants), whose integer products cost little
        more for a second row, unless the target's attention is DSpark's too (exact unpaired); off for the others.
        """
        folder = Path(path)
        manifest = read_manifest(folder)
        tokenizer = ChatTokenizer.from_dir(folder)
        if tokenizer.vocab_size > manifest.vocab_size:
            raise EngineError(f"the tokenizer in {folder} has {tokenizer.vocab_size} tokens, more than the model's "
                              f"{manifest.vocab_size}; rebuild the engine with `dspark-export build --force`")
        curve = read_speed_curve(folder, manifest)
        calibration = read_calibration(folder, manifest.gamma)
        backend = backend or OrtBackend()
        target, drafter = backend.open(folder, manifest)
        here = backend.machine()
        if exact_greedy is None:
            exact_greedy = manifest.attention != "cached" and (
                manifest.weights in EXACT_BY_DEFAULT or uses_operators(folder / TARGET_GRAPH))
        engine = cls(folder, manifest, tokenizer, target, drafter, curve and SpeedCurve.from_json(curve), calibration,
                     here, exact_greedy)
        elsewhere = curve is not None and bool(_differences(curve, here))
        if drafter is not None and (curve is None or elsewhere):
            where = "once" if curve is None else f"again: {HARDWARE_CURVE} was measured {_described(curve, here)}"
            if profile:
                print(f"profiling {folder.name} {where} (the speed curve the draft scheduler runs on; a few "
                      "seconds; `dspark-run profile` measures it more closely)...", file=sys.stderr)
                engine.profile(rounds=QUICK_PROFILE_ROUNDS)
            elif elsewhere:
                print(f"warning: {HARDWARE_CURVE} of {folder.name} was measured {_described(curve, here)}; `sync` and "
                      "`async` schedule from it until `dspark-run profile` measures this one", file=sys.stderr)
        return engine

    # ---- what tools read and set ----------------------------------------------------------------
    @property
    def gamma(self) -> int:
        """γ: draft tokens per round (0 for an engine without a drafter)."""
        return self.core.gamma

    @property
    def has_speed_curve(self) -> bool:
        """Whether the engine is profiled, which `sync` and `async` need."""
        return self.core.curve is not None

    def speedup_estimate(self, stats: RequestStats) -> float | None:
        """What a request gained against the target alone by the speed curve: τ·t(1) over the cost of its mean step,
        t(1 + drafts verified per step) plus the drafter's call on the steps that verified drafts. Overheads outside
        the graphs are left out on both sides. None for an engine not profiled or a request without steps."""
        curve = self.core.curve
        if curve is None or not stats.steps:
            return None
        sizes = np.arange(1, len(curve.target_seconds) + 1)
        verify = np.interp(1 + stats.verified / stats.steps, sizes, curve.target_seconds)
        step = verify + curve.draft_time(1) * stats.rounds / stats.steps
        return float(stats.tau * curve.target_seconds[0] / step)

    def step_seconds(self) -> dict[str, float]:
        """Seconds spent so far in steps, and in their parts: "schedule", "target", "drafter"."""
        return dict(self.core.seconds)

    def gate_steps(self) -> dict[str, int]:
        """Steps of `sync`/`async` requests so far, by the draft gate's decision: "draft" (their survivals say it
        pays), "probe" (a request looks again), "plain" (nothing drafted); and "free": steps that verified free
        drafts (`dspark_runtime.ngram`)."""
        return self.core.gate_steps()

    def status(self) -> dict[str, int]:
        """Requests running and queued, and cache slots free (all of them when idle)."""
        with self._lock:
            load = self.core.load()
            return load | {"waiting": load["waiting"] + len(self._inbox)}

    def finish_reasons(self) -> dict[str, int]:
        """How many requests have ended so far, by finish reason ("stop", "length", "cancelled", "error")."""
        return dict(self.core.finished)

    def _change(self, change: Callable[[EngineCore], None]) -> None:
        """Have the step loop apply `change` to the core before its next step (callers never set core state)."""
        with self._lock:
            self._changes.append(change)
            self._work.notify()

    def cancel(self, request_id: int) -> None:
        """Stop a request (queued or running) at the next step; its slot is freed and it ends "cancelled"."""
        self._change(lambda core: core.cancel(request_id))

    @contextmanager
    def record_rounds(self) -> Iterator[list[tuple[int, np.ndarray, int]]]:
        """Collect (request id, confidence logits, drafts accepted) of every full-length verification round from
        the next step on."""
        rounds: list[tuple[int, np.ndarray, int]] = []
        self._change(lambda core: setattr(core, "round_log", rounds))
        try:
            yield rounds
        finally:
            self._change(lambda core: setattr(core, "round_log", None))

    @property
    def calibration(self) -> dict[float, tuple[np.ndarray, np.ndarray]]:
        """The STS fits in use: (temperatures, offsets) per draft position, by the sampling temperature fitted at."""
        return self.core.sts

    def set_calibration(self, reports: dict[float, dict]) -> None:
        """Use these STS fits (calibration reports by sampling temperature) from the next step on."""
        sts = sts_by_temperature(reports) or None
        self._change(lambda core: core.set_sts(sts))

    def set_draft_gate(self, enabled: bool) -> None:
        """`sync`/`async` skip drafting when it would not pay (the default); False drafts every step, as in the
        paper (from the next step on)."""
        self._change(lambda core: core.set_draft_gate(enabled))

    def profile(self, context: int = 256, rounds: int = 5, progress=None) -> dict:
        """Measure the speed curve in `rounds` interleaved rounds, write hardware_curve.json and use it. It runs on
        the step loop once no request holds a cache slot (the timed calls write every slot's cache): requests
        running finish first, and ones submitted meanwhile wait until it is done."""
        from dspark_runtime.profiling import profile

        def measure(core: EngineCore) -> dict:
            curve = profile(core.target, core.drafter, self.manifest, self.folder, self.machine, context, rounds,
                            progress)
            core.set_curve(SpeedCurve.from_json(curve))
            return curve

        return self._when_idle(measure)

    def _when_idle(self, work: Callable[[EngineCore], Any]) -> Any:
        """`work(core)` on the loop's thread with no request in a slot (new ones held back until it returns);
        its result, or its exception raised here."""
        done, outcome = threading.Event(), {}

        def run(core: EngineCore) -> None:
            try:
                outcome["value"] = work(core)
            except BaseException as exc:  # handed to the caller, not the loop
                outcome["error"] = exc
            finally:
                done.set()

        with self._lock:
            if self._closed:
                raise DSparkError("the engine has been shut down")
            self._exclusive.append(run)
            self._work.notify()
        done.wait()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    # ---- submission -----------------------------------------------------------------------------
    def speculation(self, spec: str | None) -> SpecMode:
        """The mode `spec` names on this engine (None: its default), or `InvalidRequestError` saying why it cannot
        run here (unknown, K beyond γ, drafting without a drafter, scheduling without a speed curve)."""
        if spec is not None and not isinstance(spec, str):
            raise InvalidRequestError(f"spec must be a string such as 'async' or 'fixed:4', not {type(spec).__name__}")
        mode = SpecMode.parse(spec, self.gamma, scheduled=self.has_speed_curve)
        if mode.drafting and not self.gamma:
            raise InvalidRequestError(f"spec={mode} needs an engine with a drafter; this one is target-only")
        if mode.kind in ("sync", "async") and not self.has_speed_curve:
            raise InvalidRequestError(
                f"spec={mode} needs {HARDWARE_CURVE}: run `dspark-run profile` on this engine first"
            )
        return mode

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, spec: str | None = None,
               truncate: bool = False, stream: bool = True) -> Request:
        """Queue a request; it starts as soon as a cache slot is free. `stream=False` delivers its text in one
        delta at the end (no per-step work for a caller that only wants the result). A prompt longer than the
        context is an error, or with `truncate` loses its beginning, leaving room for min(max_tokens, half the
        context) of reply (`Request.dropped_tokens` says how many). Anything wrong with the request raises
        `InvalidRequestError` here, before it is queued."""
        params = self.default_params() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, not {type(params).__name__}")
        invalid = [t for t in params.stop_token_ids if t >= self.manifest.vocab_size]
        if invalid:
            raise InvalidRequestError(f"stop_token_ids must lie in [0, {self.manifest.vocab_size}) (got {invalid[0]})")
        mode = self.speculation(spec)
        ids = self._encode(prompt)
        limit, whole = self.manifest.max_context - 1, len(ids)
        if whole > limit:
            if not truncate:
                raise InvalidRequestError(f"the prompt has {whole} tokens; this engine's context holds {limit}: "
                                          "shorten it")
            ids = ids[-(limit - min(params.max_tokens, limit // 2)):]  # its end, and room for the reply
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        seed = params.seed if params.seed is not None else int(np.random.SeedSequence().entropy % (1 << 63))
        ends = set() if params.ignore_eos else set(self.manifest.eos_token_ids)
        output = OutputState(
            lambda tokens: self.tokenizer.decode(tokens, skip_special_tokens=True), params.stop, stream
        )
        sequence = Sequence(next(self._ids), ids, params, mode, KeyedRandom(seed),
                            frozenset(ends | set(params.stop_token_ids)))
        request = Request(self, sequence, output, stream)
        request.dropped_tokens = whole - len(ids)
        with self._lock:
            if self._closed:
                raise DSparkError("the engine has been shut down")
            self._requests[sequence.request_id] = request
            self._inbox.append(sequence)
            self._work.notify()
        return request

    def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, spec: str | None = None, **kwargs
    ) -> Completion:
        return self.submit(prompt, params, spec, stream=False, **kwargs).result()

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, spec: str | None = None, **kwargs
    ) -> Iterator[Delta]:
        """Text deltas (`.text`, `.token_ids`, `.finish_reason` on the last); closing the iterator cancels."""
        request = self.submit(prompt, params, spec, **kwargs)
        try:
            yield from request
        finally:
            if not request.done:
                request.cancel()

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, spec: str | None = None,
             **kwargs) -> Completion:
        return self.generate(messages, params, spec, **kwargs)

    def default_params(self, **overrides: Any) -> SamplingParams:
        """The one place a request's unset fields are filled, for the API, the CLI and the server alike:
        `SamplingParams`' defaults, then the model's `generation_config.json`, then each override that is not
        None (validated by `SamplingParams`)."""
        given = {key: value for key, value in overrides.items() if value is not None}
        return SamplingParams(**(self.generation_defaults() | given))

    def generation_defaults(self) -> dict:
        """Sampling defaults from the model's generation_config.json (temperature, top_k, top_p, min_p)."""
        file = self.folder / "generation_config.json"
        config = read_json_file(file, EngineError, REBUILD) if file.is_file() else {}
        if config.get("do_sample") is False:
            return {"temperature": 0.0}
        return {key: config[key] for key in ("temperature", "top_k", "top_p", "min_p") if key in config}

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(checked_text(prompt, "the prompt"))
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            try:
                text = self.tokenizer.apply_chat_template(chat_messages(prompt), add_generation_prompt=True)
            except TokenizerError as exc:  # the messages ask for what this model's template cannot say
                raise InvalidRequestError(f"{exc} (this model's chat template)") from None
            return self.tokenizer.encode(text)
        if isinstance(prompt, (list, tuple)) and all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt
        ):
            ids = [int(t) for t in prompt]
            if any(not 0 <= t < self.manifest.vocab_size for t in ids):
                raise InvalidRequestError(f"token ids must lie in [0, {self.manifest.vocab_size})")
            return ids
        raise InvalidRequestError("a prompt is a string, a list of token ids, or a list of chat messages")

    # ---- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._inbox or self._changes or self._exclusive or self.core.busy or self._closed):
                    self._work.wait()
                if self._closed and not self.core.busy and not self._inbox and not self._exclusive:
                    return
                changes, self._changes = self._changes, []
                exclusive = [] if self.core.busy else self._exclusive
                self._exclusive = [] if exclusive else self._exclusive
                if not self._exclusive:  # held back while exclusive work waits for the slots to empty
                    for sequence in self._inbox:
                        self.core.add(sequence)
                    self._inbox.clear()
            for change in changes:
                change(self.core)
            for work in exclusive:
                work(self.core)
            try:
                changed = self.core.step()
            except Exception as exc:  # an engine fault: fail the requests in flight, keep serving
                changed = self.core.fail_all(exc)
            for sequence in changed:
                self._publish(sequence)

    def _publish(self, sequence: Sequence) -> None:
        """Turn a request's new tokens into text, end it where a stop string appeared, and hand it the text it has
        not seen yet, and its end when it finished."""
        request = self._requests.get(sequence.request_id)
        if request is None:
            return
        if request.output.add(sequence.generated[len(request.output.visible) : sequence.visible]):
            self.core.stop(sequence)
        if sequence.finish_reason is None and not request.stream:
            return
        start = request.output.sent_tokens
        delta = request.output.take(sequence.finish_reason)
        if sequence.finish_reason is not None:
            with self._lock:
                self._requests.pop(sequence.request_id, None)
            request._end(sequence)
        if sequence.error is not None:
            request._deliver(sequence.error)
        elif delta is not None:
            end = start + len(delta.token_ids)
            delta.drafted = sequence.from_draft[start:end]
            delta.verifications, request.verifications_sent = (sequence.verifications[request.verifications_sent :],
                                                               len(sequence.verifications))
            if sequence.params.logprobs is not None:
                delta.logprobs = sequence.logprobs[start:end]
            request._deliver(delta)

    def shutdown(self) -> None:
        """Cancel what is queued or running, stop the loop; later submissions raise."""
        with self._lock:
            self._closed = True
            ids = list(self._requests)
            self._changes += [lambda core, request_id=request_id: core.cancel(request_id) for request_id in ids]
            self._work.notify()
        self._thread.join(timeout=30)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _differences(curve: dict, here: dict) -> list[str]:
    """What differs between the machine a speed curve was measured on and this one, of what this one records (a
    curve's other keys, such as an older DSpark's thread pool, do not count)."""
    record = curve.get("machine")
    if not isinstance(record, dict):
        return ["the machine (an older DSpark did not record it)"]
    return [f"{key} {record.get(key)} (here: {value})" for key, value in here.items() if record.get(key) != value]


def _described(curve: dict, here: dict) -> str:
    """What differs between where a speed curve was measured and here, for a message."""
    return "with " + ", ".join(_differences(curve, here))
