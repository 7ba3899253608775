"""`--weights auto`: the weight format a CPU build defaults to, chosen by timing int4, w8a8 and w4a8 at the target's
shapes."""

import importlib.util

import pytest
from click.testing import CliRunner

from dspark_export import weight_choice
from dspark_export.cli import main
from dspark_export.presets import PRESETS, resolve_target
from dspark_export.weight_choice import Choice, auto_candidates, best_rate, choose_weights, probe

QWEN3_1_7B = PRESETS["qwen3-1.7b"][1]


def test_best_rate_takes_the_best_verification_width():
    step = {1: 0.040, 4: 0.050, 8: 0.090}  # a flat curve: verifying three drafts costs 1.25 one-token steps
    assert best_rate(step, 0.0, 0.0) == pytest.approx(1 / 0.040)  # nothing accepted: plain steps
    three = (1 + 0.8 + 0.8**2 + 0.8**3) / (0.050 + 0.010)
    assert best_rate(step, 0.010, 0.8) == pytest.approx(max(three, (1 - 0.8**8) / 0.2 / 0.100, 1 / 0.040))


def fake_probe(per_weight):
    def run(config, formats, rows, threads):
        return {f.name: {m: per_weight[f.name](m) for m in rows} for f in formats}
    return run


INT4 = lambda m: 1e-11 * (1 + 0.5 * (m - 1))  # noqa: E731 - each extra row costs half a row
FLAT_W8A8 = lambda m: 1.5e-11 * (1 + 0.03 * (m - 1))  # noqa: E731 - 1.5x int4's one row, nearly flat
SLOW = lambda m: 1e-10 * m  # noqa: E731 - a format out of the running


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="w8a8 is a candidate where torch is installed")
def test_a_flat_w8a8_curve_wins_speculation_and_int4_wins_plain_decoding(monkeypatch):
    monkeypatch.setattr(weight_choice, "probe", fake_probe({"int4": INT4, "w8a8": FLAT_W8A8, "w4a8": SLOW}))
    speculative = choose_weights(QWEN3_1_7B, "float32", 5, 32768, 7, 2)
    assert speculative.weights.name == "w8a8" and speculative.rates["w8a8"] > speculative.rates["int4"]
    assert "w8a8" in speculative.line() and "t(8)" in speculative.line()
    plain = choose_weights(QWEN3_1_7B, "float32", 0, 0, 0, 2)
    assert plain.weights.name == "int4" and set(plain.steps["int4"]) == {1}


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="w8a8 is a candidate where torch is installed")
def test_w8a8_must_win_by_the_margin(monkeypatch):
    """Twice int4's bytes are kept only for a clear gain: a tie goes to int4."""
    monkeypatch.setattr(weight_choice, "probe", fake_probe({"int4": INT4, "w8a8": INT4, "w4a8": SLOW}))
    assert choose_weights(QWEN3_1_7B, "float32", 5, 32768, 7, 2).weights.name == "int4"


def test_w4a8_wins_where_its_integer_products_are_faster_at_int4s_bytes(monkeypatch):
    """w4a8 reads int4's bytes: no margin; it is chosen where it times faster, for plain decoding too."""
    w4a8 = lambda m: 0.9e-11 * (1 + 0.1 * (m - 1))  # noqa: E731 - a faster row, each extra one a tenth of it
    monkeypatch.setattr(weight_choice, "probe", fake_probe({"int4": INT4, "w8a8": FLAT_W8A8, "w4a8": w4a8}))
    monkeypatch.setattr(weight_choice, "usable", lambda: True)
    assert choose_weights(QWEN3_1_7B, "float32", 5, 32768, 3, 2).weights.name == "w4a8"
    assert choose_weights(QWEN3_1_7B, "float32", 0, 0, 0, 2).weights.name == "w4a8"
    monkeypatch.setattr(weight_choice, "usable", lambda: False)  # no C compiler: not a candidate
    formats, why = auto_candidates(QWEN3_1_7B, "float32")
    assert "w4a8" not in [f.name for f in formats] and "C compiler" in why


def test_small_targets_float_builds_and_missing_torch_narrow_the_candidates(monkeypatch):
    demo = resolve_target("demo").config
    assert [f.name for f in auto_candidates(demo, "float32")[0]] == ["fp32"]
    assert [f.name for f in auto_candidates(QWEN3_1_7B, "float16")[0]] == ["fp16"]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    monkeypatch.setattr(weight_choice, "usable", lambda: False)
    formats, why = auto_candidates(QWEN3_1_7B, "float32")
    assert [f.name for f in formats] == ["int4"] and "torch" in why
    choice = choose_weights(QWEN3_1_7B, "float32", 5, 32768, 7, 2)  # one candidate: nothing to time
    assert choice == Choice(formats[0], {}, {}, why)


def test_the_probe_times_every_format_at_every_row_count():
    """A real ONNX Runtime run of the probe graph at the demo's (small) shapes."""
    demo = resolve_target("demo").config
    formats = [weight_choice.cpu_format(name) for name in weight_choice.CANDIDATES]
    formats = [f for f in formats if weight_choice.usable() or not f.int4_rows]
    timed = probe(demo, formats, [1, 4], 1)
    assert set(timed) == {f.name for f in formats}
    assert all(set(by_rows) == {1, 4} and all(t > 0 for t in by_rows.values()) for by_rows in timed.values())


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="w8a8 is a candidate where torch is installed")
def test_inspect_sizes_each_format_auto_chooses_from():
    result = CliRunner().invoke(main, ["inspect", "--target", "qwen3-8b"])
    assert result.exit_code == 0, result.output
    assert "weights auto" in result.output
    assert "memory int4" in result.output and "memory w8a8" in result.output
    demo = CliRunner().invoke(main, ["inspect", "--target", "demo"])
    assert "fp32 weights" in demo.output and "memory w8a8" not in demo.output
