"""The runtime on a tiny engine: greedy speculative output equals target-only output, alone and batched;
queueing and cancellation return every slot; bad requests fail alone; no torch is imported."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

from dspark_runtime import Engine, OrtBackend, SamplingParams
from dspark_common.errors import InvalidRequestError

torch = pytest.importorskip("torch")

from dspark_export.build import build_engine  # noqa: E402
from dspark_export.demo.tokenizer import train_tokenizer  # noqa: E402
from dspark_export.presets import resolve_target  # noqa: E402
from tests.conftest import TEXT, build_echo_engine, write_curve, write_drafter, write_hf_checkpoint  # noqa: E402
from tests.fakes import FakeBackend  # noqa: E402

PROMPTS = ["def add(", "The answer", "Hello", "def f(x):\n    return", "Hello there, friend! The"]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime")
    target = write_hf_checkpoint(root / "target", vocab_size=300, max_position_embeddings=64)
    train_tokenizer(TEXT, target, vocab_size=300)
    drafter = write_drafter(target, root / "drafter", gamma=3)
    return build_engine(resolve_target(None, target), root / "engine", drafter, "drafter", cache_slots=4,
                        max_batch_tokens=32, show_progress=False)


@pytest.fixture(scope="module")
def engine(engine_dir):
    with Engine.load(engine_dir, OrtBackend(threads=1), profile=False) as engine:
        yield engine


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("spec", ["fixed:1", "fixed:3"])
def test_greedy_speculation_equals_target_only(engine, spec):
    for prompt in PROMPTS:
        plain = engine.generate(prompt, GREEDY, spec="off")
        fast = engine.generate(prompt, GREEDY, spec=spec)
        assert fast.token_ids == plain.token_ids and fast.text == plain.text
        assert len(plain.token_ids) == 24 and plain.finish_reason == "length"
        assert plain.stats.tau == pytest.approx(1.0) and plain.stats.steps == 24
        assert fast.stats.tau == pytest.approx(24 / fast.stats.steps)


def test_batched_requests_with_mixed_params_equal_their_solo_runs(engine):
    solo = {p: engine.generate(p, GREEDY, spec="off").token_ids for p in PROMPTS}
    others = SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=3)
    requests = []
    for i, prompt in enumerate(PROMPTS * 2):
        requests.append((prompt, engine.submit(prompt, GREEDY, spec=["fixed:3", "off", "fixed:2"][i % 3])))
        requests.append((None, engine.submit(prompt + " x", others, spec="fixed:3")))
    for prompt, request in requests:
        result = request.result()
        if prompt is not None:
            assert result.token_ids == solo[prompt]


def test_a_seed_gives_off_the_same_text_whatever_runs_beside_it(engine):
    """What the README promises of a seed: `off` is unmoved by other requests in its steps."""
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=77)
    alone = engine.generate("Hello", params, spec="off").token_ids
    crowd = [engine.submit("Hello", params, spec="off") for _ in range(4)] + [
        engine.submit(prompt, SamplingParams(max_tokens=12, temperature=0.8, seed=i), spec="fixed:3")
        for i, prompt in enumerate(PROMPTS[:3])
    ]
    assert [request.result().token_ids for request in crowd[:4]] == [alone] * 4


def test_seeded_sampling_is_reproducible(engine):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=11)
    first = engine.generate("Hello", params, spec="fixed:3")
    assert engine.generate("Hello", params, spec="fixed:3").token_ids == first.token_ids


def test_streaming_deltas_add_up(engine):
    deltas = list(engine.stream("def add(", GREEDY, spec="fixed:3"))
    assert deltas[-1].finish_reason == "length"
    assert "".join(d.text for d in deltas) == engine.generate("def add(", GREEDY, spec="fixed:3").text


def test_queueing_and_cancellation_return_every_slot(engine):
    rng = np.random.default_rng(0)
    expected = {p: engine.generate(p, GREEDY, spec="fixed:3").token_ids for p in PROMPTS}
    requests = [
        (PROMPTS[i % len(PROMPTS)], engine.submit(PROMPTS[i % len(PROMPTS)], GREEDY, spec="fixed:3")) for i in range(32)
    ]
    cancelled = set(rng.choice(32, size=10, replace=False).tolist())
    for index in cancelled:
        requests[index][1].cancel()
    results = [None] * 32
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, requests[i][1].result())) for i in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for index, result in enumerate(results):
        assert result is not None
        if result.finish_reason != "cancelled":
            assert result.token_ids == expected[requests[index][0]]
        else:
            assert index in cancelled
    assert engine.status() == {"active": 0, "waiting": 0, "free_slots": 4, "slots": 4}


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), r"temperature must be in \[0, inf\)"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature=True), "temperature must be a finite number"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(max_tokens=0), r"max_tokens must be in \[1, "),
    (dict(max_tokens=10**5000), "max_tokens must be in .* an integer of 16610 bits"),
    (dict(max_tokens=12.0), "max_tokens must be an integer"),
    (dict(top_k=float("inf")), "top_k must be an integer"),
    (dict(seed=-1), r"seed must be in \[0, "),
    (dict(stop=(1,)), "stop must be a string or a list of non-empty strings"),
    (dict(stop=("",)), "stop must be a string or a list of non-empty strings"),
    (dict(stop_token_ids=(None,)), "stop_token_ids must be a list of non-negative integers"),
    (dict(presence_penalty=float("nan"), min_p=2.0), "min_p must be in .*; presence_penalty must be a finite number"),
])
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_a_temperature_below_the_floor_is_greedy():
    assert SamplingParams(temperature=1e-320).greedy and not SamplingParams(temperature=1e-3).greedy


def test_bad_requests_fail_alone(engine):
    running = engine.submit("Hello", GREEDY, spec="fixed:3")
    with pytest.raises(InvalidRequestError, match="the prompt has .* tokens; this engine's context holds 63"):
        engine.submit("Hello " * 80, GREEDY)
    with pytest.raises(InvalidRequestError, match="needs hardware_curve.json"):
        engine.submit("Hello", GREEDY, spec="sync")
    with pytest.raises(InvalidRequestError, match="unknown speculation mode"):
        engine.submit("Hello", GREEDY, spec="turbo")
    kept = engine.submit("Hello " * 80, SamplingParams(max_tokens=2, temperature=0), truncate=True)
    assert kept.result().prompt_tokens == 61 and kept.dropped_tokens == 240 - 61  # its end, and 2 for the reply
    long_reply = engine.generate("Hello " * 80, SamplingParams(max_tokens=100, temperature=0), truncate=True)
    assert long_reply.prompt_tokens == 63 - 31 and len(long_reply.token_ids) > 30  # room for half the context
    template, engine.tokenizer.chat_template = engine.tokenizer.chat_template, "{{ raise_exception('no tools') }}"
    try:  # a role the model's template cannot render is the request's fault, not the server's
        with pytest.raises(InvalidRequestError, match="no tools .this model's chat template"):
            engine.submit([{"role": "tool", "content": "sunny"}], GREEDY)
    finally:
        engine.tokenizer.chat_template = template
    assert running.result().finish_reason == "length"


def test_request_after_shutdown(engine_dir):
    engine = Engine.load(engine_dir, OrtBackend(threads=1), profile=False)
    engine.shutdown()
    with pytest.raises(Exception, match="shut down"):
        engine.submit("Hello", GREEDY)


def test_runtime_imports_no_torch():
    code = "import sys, dspark_runtime, dspark_runtime.engine; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_an_error_class_does_not_load_the_engine():
    """The exporter imports the shared errors; that must not load the engine, ONNX Runtime or the tokenizer."""
    code = ("import sys, dspark_export.config, dspark_common.errors; loaded = [m for m in sys.modules if m in "
            "('dspark_runtime.engine', 'onnxruntime', 'tokenizers')]; print(loaded); sys.exit(1 if loaded else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    from dspark_runtime import Engine, SamplingParams  # the package's names still resolve
    assert Engine.__module__ == "dspark_runtime.engine" and SamplingParams.__name__ == "SamplingParams"


@pytest.fixture(scope="module")
def echo_engine_dir(tmp_path_factory):
    return build_echo_engine(tmp_path_factory.mktemp("echo"))


def test_accepted_drafts_are_committed_correctly(echo_engine_dir):
    with Engine.load(echo_engine_dir, OrtBackend(threads=1)) as engine:
        for prompt in PROMPTS:
            plain = engine.generate(prompt, GREEDY, spec="off")
            fast = engine.generate(prompt, GREEDY, spec="fixed:3")
            assert fast.token_ids == plain.token_ids
            assert fast.stats.accepted_per_step >= 1.0  # the first draft always passes
            assert fast.stats.tau > 1.8


def test_a_stop_string_ends_the_request_where_its_text_is_made(echo_engine_dir):
    """The text ends before the stop string, in every mode and streamed or not, the request finishes "stop" at once
    (no token after the step that completed it) and its slot is free."""
    from dataclasses import replace

    with Engine.load(echo_engine_dir, OrtBackend(threads=1)) as engine:
        plain = engine.generate(PROMPTS[4], GREEDY, spec="off").text
        stop = plain[len(plain) // 3 : len(plain) // 3 + 3]
        params = replace(GREEDY, stop=(stop,))
        for spec in ("off", "fixed:3"):
            for stream in (True, False):
                request = engine.submit(PROMPTS[4], params, spec, stream=stream)
                text = "".join(delta.text for delta in request)
                reply = request.result()
                assert reply.finish_reason == "stop" and text == reply.text == plain[: plain.index(stop)], spec
                assert stop not in text and reply.completion_tokens < GREEDY.max_tokens
        assert engine.status()["free_slots"] == engine.status()["slots"]


def test_each_token_says_whether_it_was_an_accepted_draft(echo_engine_dir):
    """A delta's `drafted` flags, its spans and its target steps add up to the request's figures; `off` drafts
    nothing."""
    with Engine.load(echo_engine_dir, OrtBackend(threads=1)) as engine:
        decode = lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        for spec in ("fixed:3", "off"):
            request = engine.submit(PROMPTS[0], GREEDY, spec)
            deltas = list(request)
            stats = request.result().stats
            for delta in deltas:
                assert len(delta.drafted) == len(delta.token_ids)
                assert "".join(text for text, _ in delta.spans(decode)) == delta.text
            steps = [step for delta in deltas for step in delta.verifications]
            assert len(steps) == stats.steps - 1  # every decoding step (the prefill drafts nothing)
            assert sum(accepted for _, _, accepted in steps) == stats.accepted
            assert sum(verified for _, verified, _ in steps) == stats.verified
            assert sum(proposed for proposed, _, _ in steps) <= stats.drafted
            flags = [flag for delta in deltas for flag in delta.drafted]
            assert stats.accepted - 1 <= sum(flags) <= stats.accepted  # less an accepted end token, never shown
            if spec == "off":
                assert not any(flags) and stats.drafted == stats.verified == 0
            else:
                assert sum(flags) > len(flags) / 3  # the echo drafter is right most of the time


def test_bench_command(engine_dir, tmp_path):
    from click.testing import CliRunner

    from dspark_runtime.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"domain": "code", "prompt": p}) + "\n" for p in PROMPTS))
    result = CliRunner().invoke(
        main,
        [
            "bench",
            str(engine_dir),
            "--prompts",
            str(prompts),
            "--modes",
            "off,fixed:3",
            "--concurrency",
            "1,2",
            "--max-tokens",
            "8",
            "--ignore-eos",
            "--threads",
            "1",
            "--domains",
            "code",
            "--repeats",
            "3",
            "--skip",
            "1",
            "--limit",
            "3",
            "--plot",
            str(tmp_path / "frontier.png"),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(next(line for line in result.output.splitlines() if line.startswith("{")))
    assert [(r["mode"], r["concurrency"]) for r in report["results"]] == [
        ("off", 1),
        ("fixed:3", 1),
        ("off", 2),
        ("fixed:3", 2),
    ]
    assert report["prompts"] == 3  # PROMPTS[1:4]
    assert all(r["generated_tokens"] == 8 * 3 and r["ratio_to_off"] > 0 for r in report["results"])
    for r in report["results"]:  # ratios within each of the three rounds, then their median
        assert len(r["ratio_to_off_by_round"]) == 3 and r["ratio_to_off"] == np.median(r["ratio_to_off_by_round"])
    for r in report["results"]:
        parts = [r[f"{part}_share_of_step_time"] for part in ("scheduler", "target", "drafter")]
        assert all(0 <= share < 1 for share in parts) and sum(parts) < 1 and r["target_share_of_step_time"] > 0
        assert (r["drafter_share_of_step_time"] > 0) == (r["mode"] != "off")
    assert (tmp_path / "frontier.png").stat().st_size > 1000
    bad = CliRunner().invoke(main, ["bench", str(engine_dir), "--concurrency", "0,x"])
    assert bad.exit_code == 2
    unknown = CliRunner().invoke(main, ["bench", str(engine_dir), "--prompts", str(prompts), "--domains", "poetry"])
    assert unknown.exit_code == 2 and "no prompt has a domain" in unknown.output


def test_prompt_files_split_per_domain(tmp_path):
    from dspark_common.prompts import read_prompts

    file = tmp_path / "prompts.jsonl"
    rows = [{"domain": d, "prompt": f"{d}{i}"} for i in range(4) for d in ("code", "chat")]
    file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    prompts = lambda *args: [r["prompt"] for r in read_prompts(file, *args)]  # noqa: E731
    assert prompts() == [r["prompt"] for r in rows]
    assert prompts(1) == ["code0", "chat0"]
    assert prompts(2, 1) == ["code1", "chat1", "code2", "chat2"]
    assert prompts(None, 3) == ["code3", "chat3"] and prompts(None, 4) == []


def test_profile_then_scheduled_modes_stay_lossless(tmp_path_factory):
    from click.testing import CliRunner

    from dspark_runtime.cli import main

    engine_dir = build_echo_engine(tmp_path_factory.mktemp("scheduled"))
    result = CliRunner().invoke(main, ["profile", str(engine_dir), "--rounds", "2", "--threads", "1"])
    assert result.exit_code == 0, result.output
    curve = json.loads((engine_dir / "hardware_curve.json").read_text())
    assert len(curve["target_seconds"]) == 8 * (3 + 1) and np.all(np.diff(curve["target_seconds"]) >= 0)
    assert curve["machine"]["threads"] == 1 and "spread between rounds" in result.output
    assert len(curve["draft_seconds"]) == 8 and curve["draft_seconds_per_context_row"] >= 0
    assert len(curve["greedy_draft_seconds"]) == 8 and "ms greedy" in result.output  # all-greedy calls timed apart
    assert curve["one_row_drift"] == 0.0 and "note: on this CPU" not in result.output  # fp32: one kernel for both
    with Engine.load(engine_dir, OrtBackend(threads=1)) as engine:
        for prompt in PROMPTS[:3]:
            plain = engine.generate(prompt, GREEDY, spec="off").token_ids
            for spec in ("sync", "async"):
                assert engine.generate(prompt, GREEDY, spec=spec).token_ids == plain


def test_profile_says_when_its_rounds_were_timed_on_a_busy_machine():
    """The gate prices every decision from the curve: one timed beside other work (rounds 32% apart) put `async` at
    0.88x `off` at Qwen3-8B's shape where a quiet one gave parity, so `profile` says to measure again."""
    from dspark_runtime.cli import profile_notes

    steep = [0.0467 * (1 + 0.31 * b) for b in range(8)]  # the grown 1.7B int4 engine on an AMX Xeon: t(8) 3.2 t(1)
    quiet = {"spread": {"target": 0.06, "drafter": 0.2}, "one_row_drift": 0.0, "target_seconds": steep}
    assert profile_notes(quiet) == [] and profile_notes(quiet, "fp32") == [] and profile_notes(quiet, "w8a8") == []
    busy = profile_notes(quiet | {"spread": {"target": 0.32, "drafter": 0.01}})
    assert len(busy) == 1 and "quiet machine" in busy[0]
    drifting = quiet | {"one_row_drift": 7.7e-3}
    assert "--exact-greedy" in profile_notes(drifting)[0] and "1.31x" in profile_notes(drifting)[0]
    assert "runs every step in pairs" in profile_notes(drifting, "w8a8", paired=True)[0]
    costly = profile_notes(quiet, "int4")
    assert len(costly) == 1 and "3.2 one-token steps with int4" in costly[0] and "--weights w8a8" in costly[0]
    flat = quiet | {"target_seconds": [0.06 * (1 + 0.04 * b) for b in range(8)]}
    assert profile_notes(flat, "int4") == []


def test_profile_measures_a_one_row_kernel_that_differs(echo_engine_dir):
    """A target that computes a token alone otherwise than in a batch (as ONNX Runtime's int4 kernels do on AVX2
    without VNNI) is caught by `one_row_drift`, which `dspark-run profile` reports."""
    from dspark_common.engine_dir import read_manifest
    from dspark_runtime.profiling import one_row_drift

    manifest = read_manifest(echo_engine_dir)
    target, _ = OrtBackend(threads=1).open(echo_engine_dir, manifest)
    run = target.run
    assert one_row_drift(target, manifest, 4) == 0.0

    def one_row_differs(batch):
        outputs = dict(run(batch))
        if len(batch.input_ids) == 1:
            outputs["logits"] = outputs["logits"] + np.float32(1e-3)
        return outputs

    target.run = one_row_differs
    assert one_row_drift(target, manifest, 4) == pytest.approx(1e-3, rel=1e-2)


def test_scheduled_modes_stop_drafting_when_the_drafter_costs_more_than_it_saves(echo_engine_dir, tmp_path,
                                                                                curve_as_written):
    """With a drafter that costs ten target steps, `sync` and `async` run the drafter only to look now and then
    (verifying free drafts between: this target repeats itself) and stay lossless; with a free drafter they draft
    every step. The curve is taken as written: the loop's own costs do not reprice it (`test_loop_costs`)."""
    folder = tmp_path / "engine"
    shutil.copytree(echo_engine_dir, folder)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for draft_seconds, most_steps_draft in ((0.01, False), (0.0, True)):
        write_curve(folder, [0.001] * 256, [draft_seconds] * 8)
        with Engine.load(folder, OrtBackend(threads=1)) as engine:
            plain = engine.generate(PROMPTS[0], params, spec="off").token_ids
            for spec in ("sync", "async"):
                before = engine.gate_steps()
                out = engine.generate(PROMPTS[0], params, spec=spec)
                gate = {kind: n - before[kind] for kind, n in engine.gate_steps().items()}
                assert out.token_ids == plain
                assert (gate["draft"] > out.stats.steps // 2) == most_steps_draft, (spec, gate, out.stats)
                assert most_steps_draft or (gate["probe"] <= 3 and gate["free"] > 0), (spec, gate)


def test_a_curve_from_another_machine_or_thread_count_is_measured_again(echo_engine_dir, tmp_path, capsys):
    folder = tmp_path / "engine"
    shutil.copytree(echo_engine_dir, folder)
    write_curve(folder, [0.001] * 32, [0.001] * 8, threads=2)  # this machine, but two threads
    with Engine.load(folder, OrtBackend(threads=1), profile=False):
        pass
    assert "was measured with threads 2 (here: 1)" in capsys.readouterr().err  # kept, with a warning naming why
    with Engine.load(folder, OrtBackend(threads=1)) as engine:
        assert engine.machine["threads"] == 1
    assert "profiling engine again" in capsys.readouterr().err
    remeasured = json.loads((folder / "hardware_curve.json").read_text())
    assert remeasured["machine"] == engine.machine and remeasured["rounds"] == 3  # the quick profile of a load
    with Engine.load(folder, OrtBackend(threads=1)):  # measured here now: used as it is
        pass
    assert "profiling" not in capsys.readouterr().err


def test_calibrate_command(tmp_path_factory):
    from click.testing import CliRunner

    from dspark_runtime.cli import main

    engine_dir = build_echo_engine(tmp_path_factory.mktemp("calibrated"))
    prompts = engine_dir.parent / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"domain": "chat", "prompt": p}) + "\n" for p in PROMPTS * 8))
    result = CliRunner().invoke(main, ["calibrate", str(engine_dir), "--prompts", str(prompts), "--max-tokens", "24",
                                       "--threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(next(line for line in result.output.splitlines() if line.startswith("{")))
    assert len(report["temperatures"]) == 3 and min(report["rounds_fit"], report["rounds_held_out"]) >= 50
    saved = json.loads((engine_dir / "calibration.json").read_text())["by_temperature"]
    assert saved["1.0"]["temperatures"] == report["temperatures"]
    greedy = CliRunner().invoke(main, ["calibrate", str(engine_dir), "--prompts", str(prompts), "--max-tokens", "24",
                                       "--threads", "1", "--temperature", "0", "--bias", "--json"])
    assert greedy.exit_code == 0, greedy.output
    with Engine.load(engine_dir, OrtBackend(threads=1), profile=False) as engine:  # one fit per sampling temperature
        fits = engine.calibration
        assert sorted(fits) == [0.0, 1.0] and fits[1.0][0].tolist() == report["temperatures"]
        assert not fits[1.0][1].any() and fits[0.0][1].tolist() == json.loads(
            next(line for line in greedy.output.splitlines() if line.startswith("{")))["biases"]


def test_a_full_context_finishes_with_length(engine):
    result = engine.generate(
        "Hello there", SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True), spec="fixed:3"
    )
    assert result.finish_reason == "length"
    # 64 positions hold K/V; the last token sampled from position 63 is still emitted
    assert result.prompt_tokens + len(result.token_ids) == 65


@pytest.mark.parametrize("gamma", [None, 5])
def test_eagle3_engine_is_lossless_batched(tmp_path, gamma):
    """The EAGLE-3 baseline's step graph runs in the same loop (its entries pair features with next tokens);
    built with another γ, it unrolls that many steps."""
    target = write_hf_checkpoint(tmp_path / "target", vocab_size=300, max_position_embeddings=64)
    train_tokenizer(TEXT, target, vocab_size=300)
    drafter = write_drafter(target, tmp_path / "drafter", drafter_type="eagle3", head="none", confidence=False, gamma=3)
    folder = build_engine(resolve_target(None, target), tmp_path / "engine", drafter, "eagle3", cache_slots=4,
                          max_batch_tokens=32, show_progress=False, gamma=gamma)
    with Engine.load(folder, OrtBackend(threads=1)) as engine:  # profiled on load, like every drafter kind
        assert engine.has_speed_curve and engine.gamma == (gamma or 3)
        plain = [engine.generate(p, GREEDY, spec="off").token_ids for p in PROMPTS[:3]]
        for spec in (f"fixed:{engine.gamma}", "async"):
            handles = [engine.submit(p, GREEDY, spec=spec) for p in PROMPTS[:3]]
            assert [h.result().token_ids for h in handles] == plain


def test_the_cli_on_the_shared_thread_pool_generates_what_the_api_does(echo_engine_dir):
    """dspark-run runs both graphs on ONNX Runtime's process-wide pool (a subprocess: the pool is process state)."""
    import os

    env = os.environ | {"DSPARK_THREAD_POOL": "process"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "dspark_runtime.cli",
            str(echo_engine_dir),
            "-p",
            "Hello there",
            "--temp",
            "0",
            "-n",
            "12",
            "--spec",
            "fixed:3",
            "--completion",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    with Engine.load(echo_engine_dir, OrtBackend(threads=1)) as engine:
        expected = engine.generate("Hello there", SamplingParams(max_tokens=12, temperature=0.0), spec="fixed:3").text
    assert json.loads(run.stdout.strip().splitlines()[-1])["text"] == expected


@pytest.mark.parametrize("weights, accuracy_level",
                         [("int4", 0), ("int8", 0), ("int4", 4), ("w8a8", 4), ("w4a8", 4)])
def test_a_quantized_target_is_the_target(tmp_path, weights, accuracy_level):
    """Greedy speculation on a quantized engine equals that engine's own target-only output: by pairing every step
    on w8a8, by DSpark's own attention (rows independent, no pairs) on w4a8."""
    from dspark_export.graphs.weights import WeightFormat

    target = write_hf_checkpoint(tmp_path / "target", vocab_size=300, max_position_embeddings=64)
    train_tokenizer(TEXT, target, vocab_size=300)
    drafter = write_drafter(target, tmp_path / "drafter", gamma=3)
    folder = build_engine(resolve_target(None, target), tmp_path / "engine", drafter, "drafter", cache_slots=4,
                          max_batch_tokens=32, show_progress=False, weights=WeightFormat(weights, 16, accuracy_level))
    with Engine.load(folder, OrtBackend(threads=1)) as engine:
        # w8a8 engines run every step in pairs unless told otherwise (exact greedy output on every CPU); w4a8 ones
        # have DSpark's attention, which computes a lone row as in a batch
        assert engine.manifest.attention == ("cached" if weights == "w4a8" else "gqa")
        assert engine.core.row_multiple == (2 if weights == "w8a8" else 1)
        assert engine.core.drafting.loop_costs.row_multiple == engine.core.row_multiple  # drafts priced as padded
        plain = [engine.generate(p, GREEDY, spec="off").token_ids for p in PROMPTS]
        for spec in ("fixed:1", "fixed:3", "async"):
            handles = [engine.submit(p, GREEDY, spec=spec) for p in PROMPTS]
            assert [h.result().token_ids for h in handles] == plain, spec
    if weights == "w8a8":
        with Engine.load(folder, OrtBackend(threads=1), exact_greedy=False) as engine:
            assert engine.core.row_multiple == 1


def test_a_request_that_fails_in_the_step_loop_fails_alone(engine_dir):
    """One request's fault (here: the model's logits after its prompt are NaN, on a pure-numpy target) ends that
    request with an error; the others in the same steps finish token for token as they would alone."""
    poison = 7
    with Engine.load(engine_dir, FakeBackend(poison=poison)) as engine:
        prompts = [[10, 11, 12], [20, 21], [30, 31, 32, 33]]
        alone = [engine.generate(p, GREEDY).token_ids for p in prompts]
        handles = [engine.submit(p, GREEDY) for p in prompts]
        bad = engine.submit([40, poison], GREEDY)
        assert [h.result().token_ids for h in handles] == alone
        with pytest.raises(Exception, match="request failed: DSparkError: the target's logits for this request are "
                                            "not finite"):
            bad.result()
        assert bad.finish_reason == "error" and engine.finish_reasons()["error"] == 1
        assert engine.status()["free_slots"] == engine.status()["slots"]


@pytest.mark.parametrize("spec", ["off", "fixed:3"])
def test_a_seed_gives_the_same_text_whatever_runs_beside_it(engine, spec):
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=11, ignore_eos=True)
    alone = engine.generate("Hello", params, spec=spec).token_ids
    crowd = [engine.submit(p, SamplingParams(max_tokens=20, temperature=1.0, seed=s), spec=spec)
             for s, p in enumerate(PROMPTS)]
    same = [engine.submit("Hello", params, spec=spec) for _ in range(3)]
    assert [h.result().token_ids for h in same] == [alone] * 3
    assert all(h.result().finish_reason for h in crowd)


def test_results_and_iteration_can_be_repeated(engine):
    request = engine.submit("Hello", GREEDY, spec="fixed:3")
    first = request.result()
    assert request.result() == first
    assert "".join(d.text for d in request) == "".join(d.text for d in request) == first.text


@pytest.mark.parametrize("call, message", [
    (lambda e: e.generate(5), "a prompt is a string"),
    (lambda e: e.generate("x", {"max_tokens": 3}), "params must be a SamplingParams"),
    (lambda e: e.generate("x", GREEDY, spec=5), "spec must be a string"),
    (lambda e: e.generate("\ud800", GREEDY), "not valid Unicode"),
    (lambda e: e.chat([{"role": "user", "content": 5}], GREEDY), "content must be a string or a list of text parts"),
    (lambda e: e.chat([{"content": "hi"}], GREEDY), "needs a role"),
    (lambda e: e.generate("x", SamplingParams(stop_token_ids=(10**6,))), "stop_token_ids must lie in"),
])
def test_wrong_arguments_are_clear_errors(engine, call, message):
    with pytest.raises(InvalidRequestError, match=message):
        call(engine)


def test_chat_content_parts_are_joined(engine):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    plain = [{"role": "user", "content": "Hello there"}]
    assert engine.chat(parts, GREEDY).token_ids == engine.chat(plain, GREEDY).token_ids


def test_exact_greedy_pads_every_step_to_pairs_and_keeps_every_mode_alike(tmp_path):
    """With `exact_greedy`, a step of an odd number of tokens carries one more (a copy of its last at the next
    position, which no row reads), so every row runs in a pair as verification's rows do: on an int4 engine in blocks
    of 64 (whose lone rows, alone or last in an odd batch, differ from paired ones on AVX2 CPUs and with AVX-512 VNNI)
    greedy output is then the same in every mode on any CPU."""
    from dspark_export.graphs.weights import WeightFormat
    from types import SimpleNamespace

    from dspark_runtime.batches import lay_out

    target = write_hf_checkpoint(tmp_path / "target", vocab_size=300, max_position_embeddings=64)
    train_tokenizer(TEXT, target, vocab_size=300)
    drafter = write_drafter(target, tmp_path / "drafter", gamma=3)
    folder = build_engine(resolve_target(None, target), tmp_path / "engine", drafter, "drafter", cache_slots=2,
                          max_batch_tokens=32, show_progress=False, weights=WeightFormat("int4", 64))
    with Engine.load(folder, OrtBackend(threads=1), exact_greedy=True) as engine:
        plain = [engine.generate(p, GREEDY, spec="off").token_ids for p in PROMPTS]
        for spec in ("fixed:1", "fixed:2", "fixed:3", "async"):
            assert [engine.generate(p, GREEDY, spec=spec).token_ids for p in PROMPTS] == plain, spec
        decoding = SimpleNamespace(decoding=True, request_id=0, anchor=7, drafts=None, slot=1, target_len=2)
        rows, batch = lay_out([decoding], {0: 0}, engine.manifest, row_multiple=2)
        assert batch.input_ids.tolist() == [7, 7] and batch.pos.tolist() == [2, 3] and batch.slot.tolist() == [1, 1]
        assert batch.logit_index.tolist() == [0] and (rows[0].count, rows[0].logit_count) == (1, 1)
        decoding.drafts = np.asarray([8, 9, 10])
        rows, batch = lay_out([decoding], {0: 2}, engine.manifest, row_multiple=2)
        assert batch.input_ids.tolist() == [7, 8, 9, 9] and batch.pos.tolist() == [2, 3, 4, 5]
        assert batch.logit_index.tolist() == [0, 1, 2] and (rows[0].count, rows[0].logit_count) == (3, 3)


def test_a_ratio_is_against_off_in_the_same_round_and_the_free_drafter_removes_the_drafters_time():
    from dspark_runtime.bench import _add_ratios

    same_round = [{"mode": "off", "tokens_per_s": 10.0, "drafter_share_of_step_time": 0.0},
                  {"mode": "fixed:3", "tokens_per_s": 15.0, "drafter_share_of_step_time": 0.25}]
    for result in same_round:
        _add_ratios(result, same_round)
    assert [r["ratio_to_off"] for r in same_round] == [1.0, 1.5]
    assert same_round[1]["ratio_with_free_drafter"] == 2.0  # 15 tok/s less a quarter of the time: 20 tok/s
    alone = {"mode": "fixed:3", "tokens_per_s": 15.0, "drafter_share_of_step_time": 0.25}
    _add_ratios(alone, [alone])
    assert alone["ratio_to_off"] is None and alone["ratio_with_free_drafter"] is None


def test_one_speed_curve_serves_every_entry_point(tmp_path, capfd):
    """`dspark-run profile` (shared pool), then the Python API (per-session pools) and `dspark-run -p`: neither
    profiles again nor rewrites hardware_curve.json."""
    folder = build_echo_engine(tmp_path)
    (folder / "hardware_curve.json").unlink(missing_ok=True)
    cli = [sys.executable, "-m", "dspark_runtime.cli"]
    profiled = subprocess.run([*cli, "profile", str(folder), "--rounds", "1", "--threads", "1"], capture_output=True,
                              text=True)
    assert profiled.returncode == 0, profiled.stderr
    curve = (folder / "hardware_curve.json").read_bytes()
    with Engine.load(folder, OrtBackend(threads=1)) as engine:
        assert engine.has_speed_curve
    assert "profiling" not in capfd.readouterr().err
    chat = subprocess.run([*cli, str(folder), "-p", "Hello", "-n", "4", "--threads", "1"], capture_output=True,
                          text=True)
    assert chat.returncode == 0 and "profiling" not in chat.stderr, chat.stderr
    assert (folder / "hardware_curve.json").read_bytes() == curve


def test_profiling_while_a_request_streams_leaves_its_text_alone(echo_engine_dir):
    """`Engine.profile` from another thread while a request streams: it waits for the slots to empty (its timed calls
    write every slot's cache), the request's text is what it is alone, and a request sent meanwhile runs after."""
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    with Engine.load(echo_engine_dir, OrtBackend(threads=1)) as engine:
        alone = engine.generate(PROMPTS[3], params, spec="fixed:3").text
        deltas = iter(engine.submit(PROMPTS[3], params, spec="fixed:3"))
        text, curves = [next(deltas).text], []
        profiler = threading.Thread(target=lambda: curves.append(engine.profile(context=8, rounds=1)))
        profiler.start()
        text += [delta.text for delta in deltas]
        later = engine.submit(PROMPTS[3], params, spec="fixed:3")
        profiler.join(60)
        assert "".join(text) == alone and later.result().text == alone
        assert curves and len(curves[0]["target_seconds"]) >= 1 and engine.has_speed_curve
