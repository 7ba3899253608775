"""Drafters: the block mask, the loss terms by hand, a few training steps, target mismatches."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dspark_export.config import DecoderConfig  # noqa: E402
from dspark_export.drafters.anchors import block_mask, build_blocks  # noqa: E402
from dspark_export.drafters.checkpoint import attach_target, build_drafter, load_drafter, save_drafter  # noqa: E402
from dspark_export.drafters.config import DrafterConfig, default_feature_layers  # noqa: E402
from dspark_export.drafters.data import Sequences  # noqa: E402
from dspark_common.sampling import SamplingParams  # noqa: E402
from dspark_export.drafters.losses import DSPARK_WEIGHTS, drafter_loss  # noqa: E402
from dspark_export.drafters.train import DrafterTrainConfig, train_drafter  # noqa: E402
from dspark_export.model import DecoderModel  # noqa: E402
from dspark_common.errors import ConfigError  # noqa: E402
from dspark_export.interop import open_drafter  # noqa: E402

TARGET = DecoderConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, rope_theta=10000.0, tie_word_embeddings=False)


def drafter_config(kind="dspark", head="markov", **overrides) -> DrafterConfig:
    fields = dict(drafter_type=kind, target=TARGET.architecture_fields() | {"dtype": "float32"}, vocab_hash="abc",
                  mask_token_id=3, num_layers=1, gamma=4, feature_layers=(1, 2), head=head, markov_rank=8,
                  confidence=kind == "dspark")
    if kind != "dspark":
        fields["head"] = "none"
    return DrafterConfig(**(fields | overrides))


@pytest.fixture
def target() -> DecoderModel:
    torch.manual_seed(0)
    model = DecoderModel(TARGET).eval()
    with torch.no_grad():  # a peaked target, so that there is something to learn
        model.lm_head.weight.mul_(3)
    return model


def test_feature_layer_defaults():
    assert default_feature_layers(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B, as in DFlash/DSpark
    assert default_feature_layers(6, 1) == (3,)
    assert default_feature_layers(6, 2) == (1, 3)


def test_block_mask_constructed_case():
    mask = block_mask(torch.tensor([[2, 5]]), context_length=8, rows=3)[0, 0].int()
    expected = torch.zeros(6, 14, dtype=torch.int32)
    expected[0:3, 0:2] = 1  # anchor 2: context strictly before position 2 (never its own feature)
    expected[3:6, 0:5] = 1  # anchor 5: positions 0..4
    expected[0:3, 8:11] = 1  # each block sees all of itself (bidirectional) ...
    expected[3:6, 11:14] = 1  # ... and nothing of the other block
    assert torch.equal(mask, expected)


def test_blocks_inputs_labels_and_validity():
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15, 0, 0]])
    blocks = build_blocks(
        tokens, torch.tensor([6]), torch.tensor([3]), torch.tensor([[2, 4]]), gamma=3, mask_token_id=99
    )
    assert blocks.input_ids.tolist() == [[[12, 99, 99], [14, 99, 99]]]
    assert blocks.previous.tolist() == [[[12, 13, 14], [14, 15, 0]]]  # past the end: padding, masked below
    assert blocks.labels[0, 0].tolist() == [13, 14, 15]
    assert blocks.valid.tolist() == [[[True, True, True], [True, False, False]]]  # labels past the end are invalid


def test_block_drafter_never_peeks(target):
    drafter = build_drafter(drafter_config())
    attach_target(drafter, target)
    features = torch.randn(1, 10, 2 * TARGET.hidden_size)
    anchors = torch.tensor([[3, 6]])
    ids = torch.tensor([[5, 3, 3, 3, 7, 3, 3, 3]])
    positions = torch.tensor([[3, 4, 5, 6, 6, 7, 8, 9]])

    def run(features, ids):
        return drafter.backbone(
            ids, positions, drafter.fuse(features), torch.arange(10)[None], block_mask(anchors, 10, 4)
        )

    base = run(features, ids)
    later = features.clone()
    later[:, 3:] += 5.0  # features at and after the first anchor
    other_block = ids.clone()
    other_block[0, 4] = 9  # the second block's anchor token
    assert torch.allclose(run(later, ids)[:, :4], base[:, :4], atol=1e-6)
    assert not torch.allclose(run(later, ids)[:, 4:], base[:, 4:], atol=1e-3)  # anchor 6 does see position 3..5
    assert torch.allclose(run(features, other_block)[:, :4], base[:, :4], atol=1e-6)


def test_loss_terms_by_hand():
    draft = torch.tensor([[[2.0, 0.0], [0.0, 0.0]]])  # [1, γ=2, V=2]
    target_logits = torch.tensor([[[0.0, 0.0], [0.0, 1.0]]])
    labels = torch.tensor([[0, 1]])
    valid = torch.tensor([[True, True]])
    confidence = torch.tensor([[0.0, 1.0]])
    terms = drafter_loss(draft, target_logits, labels, valid, confidence, DSPARK_WEIGHTS)
    w = np.array([1.0, math.exp(-0.25)])
    p0 = 1 / (1 + math.exp(-2))  # draft prob of token 0 at slot 0
    s1 = 1 / (1 + math.exp(-1))  # target prob of token 1 at slot 1
    ce = np.array([-math.log(p0), math.log(2)])
    tv = np.array([abs(p0 - 0.5), abs(0.5 - s1)])
    c_star = 1 - tv
    sig = 1 / (1 + np.exp(-np.array([0.0, 1.0])))
    bce = -(c_star * np.log(sig) + (1 - c_star) * np.log(1 - sig))
    expected = {"ce": (ce * w).sum() / w.sum(), "l1": (2 * tv * w).sum() / w.sum(), "bce": (bce * w).sum() / w.sum()}
    for name, value in expected.items():
        assert float(terms[name]) == pytest.approx(value, rel=1e-5), name
    assert float(terms["total"]) == pytest.approx(
        0.1 * expected["ce"] + 0.9 * expected["l1"] + expected["bce"], rel=1e-5
    )
    assert float(terms["tau"]) == pytest.approx(1 + (1 - tv[0]) + (1 - tv[0]) * (1 - tv[1]), rel=1e-5)


def greedy_sequences(target: DecoderModel, count: int = 24, prompt: int = 6, new: int = 26) -> Sequences:
    """Self-distillation data from the tiny target: random prompts, greedy continuations."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(4, TARGET.vocab_size, (count, prompt), generator=generator)
    with torch.no_grad():
        for _ in range(new):
            next_ids = target(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_ids], 1)
    lengths = np.full(count, prompt + new, dtype=np.int32)
    return Sequences(ids.numpy().astype(np.uint16).ravel(), np.arange(count) * (prompt + new), lengths,
                     np.full(count, prompt, dtype=np.int32))


def test_several_distillation_files_train_as_one_set(tmp_path):
    files = []
    for index, sequences in enumerate(([[5, 6, 7], [8, 9]], [[10, 11, 12, 13]])):
        lengths = np.array([len(seq) for seq in sequences], np.int32)
        np.savez(
            tmp_path / f"{index}.npz",
            tokens=np.concatenate(sequences).astype(np.uint16),
            starts=np.r_[0, np.cumsum(lengths)[:-1]],
            lengths=lengths,
            prompt_lengths=np.ones(len(lengths), np.int32),
        )
        files.append(tmp_path / f"{index}.npz")
    data = Sequences.load(*files)
    tokens, lengths, _ = data.batch(np.array([2, 1]), max_length=8)
    assert len(data) == 3 and lengths.tolist() == [4, 2]
    assert tokens.tolist() == [[10, 11, 12, 13], [8, 9, 0, 0]]


@pytest.mark.parametrize(
    "kind, head", [("dspark", "markov"), ("dspark", "rnn"), ("dflash", "none"), ("eagle3", "none")]
)
def test_a_few_training_steps_reduce_the_loss(tmp_path, target, kind, head):
    torch.manual_seed(0)
    drafter = build_drafter(drafter_config(kind, head))
    attach_target(drafter, target)
    cfg = DrafterTrainConfig(steps=60, batch=8, anchors=6, lr=3e-3, checkpoint_every=60)
    train_drafter(drafter, [target], greedy_sequences(target), tmp_path / "run", cfg, threads=1)
    from dspark_export.training import RunFolder

    records = RunFolder(tmp_path / "run").records()
    assert records[-1]["total"] < 0.8 * records[0]["total"], records
    save_drafter(drafter, tmp_path / "drafter")
    reloaded = load_drafter(open_drafter(tmp_path / "drafter", TARGET), target)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[name]), name


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(vocab_size=64), "vocab_size=48, but this target has vocab_size=64"),
        (dict(hidden_size=64, num_attention_heads=8), "hidden_size=32, but this target has hidden_size=64"),
    ],
)
def test_drafter_for_another_target_is_refused(tmp_path, target, change, message):
    drafter = build_drafter(drafter_config())
    save_drafter(drafter, tmp_path / "d")
    with pytest.raises(ConfigError, match=message):
        open_drafter(tmp_path / "d", DecoderConfig(**(TARGET.architecture_fields() | change)))
    with pytest.raises(ConfigError, match="vocabulary does not match"):
        DrafterConfig.from_dir(tmp_path / "d").check_target(TARGET, vocab_hash="another")


def test_feature_layer_beyond_the_target_is_refused():
    with pytest.raises(ConfigError, match=r"within -1\.\.3 \(the target has 4 layers"):
        drafter_config(feature_layers=(1, 4))
    with pytest.raises(ConfigError, match="must increase"):
        drafter_config(feature_layers=(2, 1))
    with pytest.raises(ConfigError, match="unknown drafter type"):
        drafter_config(drafter_type="medusa")


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_greedy_speculative_generation_equals_target_greedy(target, kind):
    from dspark_export.drafters.evaluate import speculative_generate, summarize

    torch.manual_seed(1)
    drafter = build_drafter(drafter_config(kind, "rnn" if kind == "dspark" else "none")).eval()
    attach_target(drafter, target)
    prompt = [5, 9, 11, 4, 20, 7]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(20):
            ids = torch.cat([ids, target(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    generation = speculative_generate(target, drafter, prompt, SamplingParams(max_tokens=20, temperature=0.0), seed=0)
    assert generation.tokens == ids[0, len(prompt):].tolist()
    summary = summarize(generation.rounds, gamma=4)
    assert 1.0 <= summary["tau"] <= 5.0 and len(summary["per_position_acceptance"]) == 4
    for r in generation.rounds:  # greedy: the true acceptance is 1 up to the first mismatch, which has 0
        assert r.acceptance[: r.accepted] == [1.0] * r.accepted and (r.accepted == 4 or r.acceptance[r.accepted] == 0.0)


def test_a_drafter_equal_to_the_target_is_always_accepted(target):
    """Positive control: with drafts taken from the target itself, every draft passes (τ = γ + 1)."""
    from dspark_export.drafters.evaluate import speculative_generate

    class Oracle(torch.nn.Module):
        config = drafter_config("dflash")

    def oracle_draft(drafter, committed, features, temperature, noise):
        from dspark_export.drafters.block_drafter import Draft

        ids = committed
        for _ in range(drafter.config.gamma):
            ids = torch.cat([ids, target(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        tokens = ids[:, committed.shape[1]:]
        return Draft(tokens, torch.nn.functional.one_hot(tokens, TARGET.vocab_size).float(), torch.ones(tokens.shape))

    generation = speculative_generate(
        target, Oracle(), [5, 9, 11], SamplingParams(max_tokens=15, temperature=0.0), seed=0, draft_fn=oracle_draft
    )
    assert [r.accepted for r in generation.rounds] == [4, 4, 4]


def test_eagle3_training_unroll_sees_what_drafting_sees(target):
    """The unrolled training chain at entry t, teacher-forced with the drafter's own greedy drafts, gives the
    drafting distributions; unrolling only some entries gives the same logits as unrolling all."""
    from dspark_export.drafters.eagle3 import eagle3_draft
    from dspark_export.drafters.train import target_pass

    torch.manual_seed(2)
    drafter = build_drafter(drafter_config("eagle3")).eval()
    attach_target(drafter, target)
    committed = torch.tensor([[5, 9, 11, 4, 20, 7, 13]])
    anchor = committed.shape[1] - 1
    with torch.no_grad():
        features, _ = target_pass(target, committed, drafter.config.feature_layers)
        draft = eagle3_draft(drafter, committed, features[:, :anchor], 1.0, torch.rand(1, 4))
        tokens = torch.cat([committed, draft.tokens], 1)
        features, _ = target_pass(target, tokens, drafter.config.feature_layers)
        every = drafter.unroll(tokens, features, 4)
        some = drafter.unroll(tokens, features, 4, torch.tensor([[anchor - 1, 2]]))
    for step in range(4):
        assert torch.allclose(torch.softmax(every[step][0, anchor - 1], -1), draft.probs[0, step], atol=1e-5), step
        assert torch.allclose(some[step][0, 0], every[step][0, anchor - 1], atol=1e-5)
        assert torch.allclose(some[step][0, 1], every[step][0, 2], atol=1e-5)


def test_compact_adamw_follows_adamw_with_half_the_state():
    from dspark_export.training import CompactAdamW

    torch.manual_seed(0)
    inputs, weights = torch.randn(256, 32), torch.randn(32, 4)
    targets = inputs @ weights
    models = [torch.nn.Linear(32, 4) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [torch.optim.AdamW(models[0].parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01),
                  CompactAdamW(models[1].parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)]
    losses = [[], []]
    for _ in range(200):
        for model, optimizer, curve in zip(models, optimizers, losses):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            curve.append(loss.item())
    assert losses[1][-1] < 0.05 * losses[1][0]
    assert abs(losses[1][-1] - losses[0][-1]) < 0.05 * losses[0][-1]
    a, b = (torch.nn.utils.parameters_to_vector(m.parameters()) for m in models)
    assert (a - b).norm() < 1e-2 * a.norm()
    state = optimizers[1].state[models[1].weight]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
