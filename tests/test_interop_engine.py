"""Imported drafters end to end: engines built with another layout's drafter are lossless, `convert` round-trips
through the layouts vLLM and DeepSpec load, the target-layer convention is Hugging Face's `hidden_states[i + 1]`
(an off-by-one visibly changes the drafts), and bad drafter folders fail with one line and write nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dspark_export.build import build_engine
from dspark_export.checkpoint import Checkpoint, read_header, tensor_view, write_safetensors
from dspark_export.cli import main
from dspark_export.config import DecoderConfig
from dspark_export.drafters.bundled import resolve_drafter
from dspark_export.drafters.config import DrafterConfig
from dspark_export.presets import resolve_target
from dspark_runtime import Engine, OrtBackend, SamplingParams
from tests.conftest import SAMPLES, TEXT, drafter_feeds, exact_joint, p_value, sample_pairs, write_curve

FIXTURES = Path(__file__).parent / "fixtures" / "interop"
PROMPTS = ["def add(a, b):", "The answer is", "Hello there"]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """The fixtures' tiny random target, with a tokenizer so that engines can be built from it."""
    from dspark_export.demo.tokenizer import train_tokenizer

    folder = tmp_path_factory.mktemp("interop") / "target"
    shutil.copytree(FIXTURES / "target", folder)
    train_tokenizer(TEXT, folder, vocab_size=300)
    return folder


def convert(drafter: str, layout: str, out: Path, *target: str) -> Path:
    result = CliRunner().invoke(main, ["convert", drafter, *target, "--to", layout, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def generate(engine_dir: Path, params: SamplingParams, spec: str) -> list[tuple[list[int], int, int]]:
    """(tokens, rounds, accepted drafts) of each prompt; fixed modes need no hardware curve, so none is measured."""
    write_curve(engine_dir, [0.001] * 256, [0.001] * 8)
    with Engine.load(engine_dir, OrtBackend(threads=1)) as engine:
        results = [engine.submit(engine.tokenizer.encode(p), params, spec=spec).result() for p in PROMPTS]
    return [(r.token_ids, r.stats.rounds, round(r.stats.accepted_per_step * r.stats.rounds)) for r in results]


def test_convert_round_trips_and_an_off_by_one_layer_changes_the_drafts(tmp_path):
    """demo-dspark, converted to speculators and to DeepSpec and built again, drafts exactly as before (same
    tokens, same acceptance); the speculators copy with its layer id not shifted reads the previous layer's
    features: the text stays the target's, the drafts change."""
    layouts = {"ours": resolve_drafter("demo-dspark"),
               "speculators": convert("demo-dspark", "speculators", tmp_path / "speculators"),
               "deepspec": convert("demo-dspark", "deepspec", tmp_path / "deepspec")}
    ours = list(DrafterConfig.from_dir(layouts["ours"]).feature_layers)
    raw = json.loads((layouts["speculators"] / "config.json").read_text())
    assert raw["aux_hidden_state_layer_ids"] == [layer + 1 for layer in ours]  # our layer l is hidden_states[l + 1]
    assert json.loads((layouts["deepspec"] / "config.json").read_text())["target_layer_ids"] == ours
    shifted = shutil.copytree(layouts["speculators"], tmp_path / "shifted")
    (shifted / "config.json").write_text(json.dumps(raw | {"aux_hidden_state_layer_ids": ours}))
    layouts["shifted"] = shifted
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    runs = {}
    for name, drafter in layouts.items():
        engine = build_engine(resolve_target("demo"), tmp_path / f"engine-{name}", drafter, name, cache_slots=2,
                              max_context=128, show_progress=False)
        runs[name] = generate(engine, params, "fixed:7")
    assert runs["speculators"] == runs["ours"] and runs["deepspec"] == runs["ours"]
    assert [r[0] for r in runs["shifted"]] == [r[0] for r in runs["ours"]]  # lossless either way
    assert [r[1:] for r in runs["shifted"]] != [r[1:] for r in runs["ours"]]  # other drafts, other acceptance


def test_eagle3_converts_to_speculators_and_back(tmp_path):
    """demo-eagle3 in speculators' EAGLE-3 layout (its LM head written out, layer ids shifted) drafts as before."""
    converted = convert("demo-eagle3", "speculators", tmp_path / "speculators")
    ours = list(DrafterConfig.from_dir(resolve_drafter("demo-eagle3")).feature_layers)
    assert json.loads((converted / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [
        layer + 1 for layer in ours]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    runs = [generate(build_engine(resolve_target("demo"), tmp_path / f"engine-{i}", drafter, "eagle3", cache_slots=2,
                                  max_context=128, show_progress=False), params, "fixed:5")
            for i, drafter in enumerate((resolve_drafter("demo-eagle3"), converted))]
    assert runs[0] == runs[1]


def test_layer_convention_is_hugging_faces_hidden_states():
    """Target layer i is `hidden_states[i + 1]` of the target in transformers (the last one after the final norm;
    -1 the embeddings), in our ONNX target graph and our torch target."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from dspark_export.graphs.target import build_target_onnx
    from dspark_export.model import DecoderModel
    import onnxruntime as ort

    folder = FIXTURES / "target"
    config = DecoderConfig.from_dir(folder)
    ids = np.array([5, 9, 17, 33, 60, 7])
    hf = transformers.Qwen3ForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        states = hf(torch.from_numpy(ids)[None], output_hidden_states=True).hidden_states
    layers = (-1, 0, 2, config.num_hidden_layers - 1)
    expected = torch.cat([states[i + 1] for i in layers], -1)[0].numpy()
    ours = DecoderModel.from_checkpoint(Checkpoint(folder, config), "float32")
    with torch.no_grad():
        out = ours(torch.from_numpy(ids)[None], feature_layers=layers)
    np.testing.assert_allclose(torch.cat([out.features[i] for i in layers], -1)[0].numpy(), expected, atol=1e-4)
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        graph = build_target_onnx(Checkpoint(folder, config), Path(scratch) / "target.onnx", feature_layers=layers)
        session = ort.InferenceSession(str(graph))
        shape = (1, config.num_key_value_heads, 16, config.head_dim)
        feeds = {"input_ids": ids, "pos": np.arange(len(ids)), "slot": np.zeros(len(ids), np.int64),
                 "cache_len": np.zeros(1, np.int64), "logit_index": np.array([len(ids) - 1])}
        feeds |= {f"past_{kind}_{layer}": np.zeros(shape, np.float32) for kind in ("key", "value")
                  for layer in range(config.num_hidden_layers)}
        (features,) = session.run(["features"], feeds)
    np.testing.assert_allclose(features, expected, atol=1e-4)


@pytest.mark.parametrize("drafter", ["speculators-dspark-1n-pruned", "specforge-eagle3"])
def test_engine_with_an_imported_drafter_is_lossless(target, tmp_path, drafter):
    """Random drafters with draft vocabularies (speculators' 1+N block with an RNN head over 48 tokens; SpecForge's
    EAGLE-3 over 40): greedy output equals the target alone, sampled pairs of tokens follow the target's own
    distribution."""
    engine_dir = build_engine(resolve_target(None, target), tmp_path / "engine", FIXTURES / drafter, drafter,
                              cache_slots=8, max_context=64, show_progress=False)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert [r[0] for r in generate(engine_dir, greedy, "fixed:3")] == [
        r[0] for r in generate(engine_dir, greedy, "off")
    ]
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    with Engine.load(engine_dir, OrtBackend(threads=1)) as engine:
        prompt = engine.tokenizer.encode("Hello there")
        rounds: list[int] = []
        counts = sample_pairs(engine, prompt, params, "fixed:3", rounds)
    assert sum(rounds) > 0.5 * SAMPLES  # the drafts were verified
    assert p_value(counts, exact_joint(engine_dir, prompt, params)) > 1e-3


def test_deepspec_folder_builds_from_the_command_line_with_shared_embeddings(target, tmp_path):
    """`dspark-export build --drafter <DeepSpec folder>`: its stored copies of the target's embedding and LM head
    are the target graph's own tensors in the engine, not a second copy."""
    out = tmp_path / "engine"
    result = CliRunner().invoke(main, ["build", "--target-path", str(target), "--drafter",
                                       str(FIXTURES / "deepspec-vanilla"), "--out", str(out), "--kv-memory", "1MiB"])
    assert result.exit_code == 0, result.output
    import onnx

    drafter = onnx.load(str(out / "drafter.onnx"), load_external_data=False)
    locations = {t.name: {e.key: e.value for e in t.external_data}.get("location") for t in drafter.graph.initializer}
    assert locations["model.embed_tokens.weight"] == locations["lm_head.weight"] == "target.onnx.data"
    assert all(place in ("target.onnx.data", "drafter.onnx.data", None) for place in locations.values())
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["drafter"]["extra"] == {"layout": "deepspec"}
    assert manifest["drafter"]["own_embedding"] is False and manifest["drafter"]["own_lm_head"] is False


def rewrite(folder: Path, config: dict | None = None, tensors=None) -> Path:
    """Change a copied drafter folder's config.json (keys merged; None removes) and/or its tensors."""
    if config is not None:
        raw = json.loads((folder / "config.json").read_text()) | config
        (folder / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    if tensors is not None:
        header = read_header(folder / "model.safetensors")
        arrays = {name: (np.array(tensor_view(info)), info.dtype) for name, info in header.items()}
        write_safetensors(folder / "model.safetensors", tensors(arrays))
    return folder


def padded(arrays: dict, rows: int) -> dict:
    """Embedding and LM-head tables padded with zero rows, as Qwen pads its vocabularies."""
    tables = ("embed_tokens.weight", "lm_head.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight")
    return {name: (np.concatenate([a, np.zeros((rows - len(a), *a.shape[1:]), a.dtype)]) if name in tables else a, d)
            for name, (a, d) in arrays.items()}


def pickle_only(folder: Path) -> Path:
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    return folder


BAD_DRAFTERS = {  # case: (fixture, how to break it, the one line says)
    "unknown architecture": ("deepspec-vanilla", lambda f: rewrite(f, {"architectures": ["MedusaModel"]}),
                             "unknown drafter architecture"),
    "vocabulary beyond padding": ("deepspec-vanilla", lambda f: rewrite(f, {"vocab_size": 200}, lambda a: {
        n: (x[:200] if n in ("embed_tokens.weight", "lm_head.weight") or "markov_w" in n else x, d)
        for n, (x, d) in a.items()}), "more than padding differs"),
    "target layer outside the target": ("deepspec-rnn", lambda f: rewrite(f, {"target_layer_ids": [2, 4]}),
                                        "must increase and lie within -1..3"),
    "speculators layer outside": ("speculators-dspark", lambda f: rewrite(f, {"aux_hidden_state_layer_ids": [2, 5]}),
                                  "must increase and lie within -1..3"),
    "d2t of the wrong length": ("speculators-dspark-1n-pruned", lambda f: rewrite(f, tensors=lambda a: a | {
        "d2t": (a["d2t"][0][:40], "int64")}), "d2t in"),
    "pickle-only checkpoint": ("deepspec-vanilla", pickle_only, "never loads"),
    "trained for another depth": ("zlab-dflash", lambda f: rewrite(f, {"num_target_layers": 36}),
                                  "target of 36 layers"),
    "other attention shape": ("zlab-dflash", lambda f: rewrite(f, {"num_key_value_heads": 4}), "num_key_value_heads 4"),
    "EAGLE-3 with a norm DSpark lacks": ("speculators-eagle3", lambda f: rewrite(f, {"norm_output": True}),
                                         "sets norm_output"),
    "EAGLE-3 of two layers": ("specforge-eagle3", lambda f: rewrite(f, {"num_hidden_layers": 2}), "DSpark runs one"),
}


@pytest.mark.parametrize("case", sorted(BAD_DRAFTERS))
def test_bad_drafter_folders_fail_with_one_line_and_write_nothing(target, tmp_path, case):
    fixture, breaks, message = BAD_DRAFTERS[case]
    drafter = breaks(shutil.copytree(FIXTURES / fixture, tmp_path / "drafter"))
    out = tmp_path / "engine"
    result = CliRunner().invoke(
        main,
        ["build", "--target-path", str(target), "--drafter", str(drafter), "--out", str(out), "--kv-memory", "1MiB"],
    )
    assert result.exit_code != 0 and message in result.output, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert not out.exists() and not list(tmp_path.glob(".engine*"))


def test_a_vocabulary_padded_past_the_target_is_accepted(target, tmp_path):
    """Qwen pads 151,669 tokens to 151,936 or 152,064 rows: a drafter whose tables only add padding rows drafts
    exactly as the unpadded one."""
    from dspark_export.graphs.drafter import build_drafter_onnx
    from dspark_export.interop import open_drafter
    from dspark_common.tokenizer import ChatTokenizer

    wide = rewrite(shutil.copytree(FIXTURES / "deepspec-gated", tmp_path / "wide"), {"vocab_size": 320},
                   lambda arrays: padded(arrays, 320))
    config, checkpoint = DecoderConfig.from_dir(target), Checkpoint(target, DecoderConfig.from_dir(target))
    tokenizer = ChatTokenizer.from_dir(target)
    import onnxruntime as ort

    reference = np.load(FIXTURES / "deepspec-gated" / "reference.npz")
    for name, folder in (("narrow", FIXTURES / "deepspec-gated"), ("wide", wide)):
        source = open_drafter(folder, config, checkpoint, tokenizer)
        graph = build_drafter_onnx(source, checkpoint, tmp_path / name / "drafter.onnx")
        feeds = drafter_feeds(reference, source, float(reference["temperature"]))
        tokens, probs = ort.InferenceSession(str(graph)).run(["draft_tokens", "draft_probs"], feeds)
        assert tokens.tolist() == reference["sampled_tokens"].tolist(), name
        np.testing.assert_allclose(probs, reference["sampled_probs"], atol=1e-4)
