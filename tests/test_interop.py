"""Published drafter layouts against their own reference implementations.

`tests/fixtures/interop` holds tiny random drafters saved by DeepSpec's, speculators' and z-lab's own classes,
with what those implementations draft from fixed inputs and noise (`scripts/make_interop_fixtures.py`). Our
ONNX drafter and our torch drafter, reading the same folders, must draft the same tokens, from the same
distributions (≤ 1e-4) with the same confidences.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from dspark_export.checkpoint import Checkpoint
from dspark_export.config import DecoderConfig
from dspark_export.graphs.drafter import build_drafter_onnx
from dspark_export.interop import open_drafter
from tests.conftest import drafter_feeds

FIXTURES = Path(__file__).parent / "fixtures" / "interop"
TARGET = FIXTURES / "target"
CASES = {  # case -> (layout, our view of its layout)
    "deepspec-vanilla": (
        "deepspec",
        dict(head="markov", feature_layers=(1, 2), own_embedding=False, own_lm_head=False),
    ),
    "deepspec-gated": ("deepspec", dict(head="gated", feature_layers=(-1, 3), own_embedding=True, own_lm_head=True)),
    "deepspec-rnn": ("deepspec", dict(head="rnn", feature_layers=(0, 2), confidence_with_markov=True)),
    "deepspec-confidence-alone": ("deepspec", dict(head="markov", confidence=True, confidence_with_markov=False)),
    "deepspec-dflash": ("deepspec", dict(drafter_type="dflash", head="none", confidence=False)),
    "speculators-dspark": ("speculators", dict(head="gated", feature_layers=(1, 3), sample_from_anchor=True, gamma=4)),
    "speculators-dspark-1n-pruned": (
        "speculators",
        dict(
            head="rnn",
            feature_layers=(0, 2),
            sample_from_anchor=False,
            gamma=3,
            draft_vocab_size=48,
            own_embedding=False,
        ),
    ),
    "speculators-dflash": ("speculators", dict(drafter_type="dflash", sample_from_anchor=False, gamma=3)),
    "zlab-dflash": (
        "z-lab",
        dict(
            drafter_type="dflash",
            feature_layers=(1, 2),
            sample_from_anchor=False,
            gamma=3,
            own_embedding=False,
            own_lm_head=False,
        ),
    ),
    "speculators-eagle3": (
        "speculators",
        dict(
            drafter_type="eagle3",
            feature_layers=(0, 1, 3),
            gamma=4,
            qk_norm=True,
            norm_before_residual=True,
            draft_vocab_size=64,
            own_embedding=False,
        ),
    ),
    "specforge-eagle3": (
        "specforge",
        dict(
            drafter_type="eagle3",
            feature_layers=(1, 2, 3),
            qk_norm=False,
            norm_before_residual=False,
            draft_vocab_size=40,
            own_lm_head=True,
        ),
    ),
}


def checkpoint() -> Checkpoint:
    return Checkpoint(TARGET, DecoderConfig.from_dir(TARGET))


@pytest.mark.parametrize("case", sorted(CASES))
def test_layout_is_read_as_published(case):
    layout, expected = CASES[case]
    source = open_drafter(FIXTURES / case, DecoderConfig.from_dir(TARGET), checkpoint())
    assert source.layout == layout
    assert {key: getattr(source.config, key) for key in expected} == expected


@pytest.mark.parametrize("greedy_shortcut", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_onnx_drafter_matches_the_reference(tmp_path, case, greedy_shortcut):
    reference = np.load(FIXTURES / case / "reference.npz")
    source = open_drafter(FIXTURES / case, DecoderConfig.from_dir(TARGET), checkpoint())
    graph = build_drafter_onnx(source, checkpoint(), tmp_path / "drafter.onnx", greedy_shortcut=greedy_shortcut)
    onnx.checker.check_model(str(graph), full_check=True)
    session = ort.InferenceSession(str(graph))
    outputs = ["draft_tokens", "draft_probs"] + (["confidence_logits"] if source.config.confidence else [])
    for tag, temperature in (("greedy", 0.0), ("sampled", float(reference["temperature"]))):
        run_feeds = drafter_feeds(reference, source, temperature)
        names = {i.name for i in session.get_inputs()}
        got = dict(zip(outputs, session.run(outputs, {k: v for k, v in run_feeds.items() if k in names})))
        got = {name: value[:, : int(reference["gamma"])] for name, value in got.items()}  # SpecForge: γ is ours to pick
        assert got["draft_tokens"].tolist() == reference[f"{tag}_tokens"].tolist(), tag
        if got["draft_probs"].shape[-1]:  # an all-greedy call of the CPU graph returns no distributions
            np.testing.assert_allclose(got["draft_probs"], reference[f"{tag}_probs"], atol=1e-4)
        if source.config.confidence:
            np.testing.assert_allclose(got["confidence_logits"], reference[f"{tag}_confidence"], atol=1e-4)


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_drafter_matches_the_reference(case):
    torch = pytest.importorskip("torch")
    from dspark_export.drafters.block_drafter import block_draft
    from dspark_export.drafters.checkpoint import load_drafter
    from dspark_export.drafters.eagle3 import eagle3_draft
    from dspark_export.model import DecoderModel

    reference = np.load(FIXTURES / case / "reference.npz")
    target = DecoderModel.from_checkpoint(checkpoint(), "float32")
    drafter = load_drafter(open_drafter(FIXTURES / case, target.config, checkpoint()), target)
    gamma = drafter.config.gamma
    for tag, temperature in (("greedy", 0.0), ("sampled", float(reference["temperature"]))):
        for r in range(2):
            features = torch.from_numpy(reference[f"features_{r}"])[None]
            noise = torch.from_numpy(reference["noise"][r : r + 1, :gamma])
            if drafter.config.drafter_type == "eagle3":  # entry t holds token t + 1
                committed = torch.tensor([[0, *reference[f"context_ids_{r}"].tolist()]])
                draft = eagle3_draft(drafter, committed, features, temperature, noise)
            else:
                committed = torch.tensor([[int(reference["anchors"][r])]])
                draft = block_draft(drafter, committed, features, temperature, noise)
            n = int(reference["gamma"])
            assert draft.tokens[0, :n].tolist() == reference[f"{tag}_tokens"][r].tolist(), (tag, r)
            np.testing.assert_allclose(draft.probs[0, :n].numpy(), reference[f"{tag}_probs"][r], atol=1e-4)
            if drafter.config.confidence:
                logits = np.log(draft.confidence[0].numpy()) - np.log1p(-draft.confidence[0].numpy())
                np.testing.assert_allclose(logits, reference[f"{tag}_confidence"][r], atol=1e-3)
