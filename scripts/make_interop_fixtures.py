"""Reference fixtures for the drafter layouts DSpark imports, computed by each layout's own code.

For every case it writes a tiny random drafter in that layout (the authors' classes save it) and
`reference.npz`: the inputs (target features of two requests, their anchors, one uniform per draft) and
what the layout's own implementation makes of them: greedy drafts, sampled drafts with the distributions
they come from, and confidence logits. `tests/test_interop.py` checks DSpark's ONNX drafter against them.
A draw takes the layout's own distribution and the shared uniform by inverse CDF (the rule DSpark's graphs
use); everything that makes the distribution (backbone, heads, vocabulary map) is the layout's code.

It needs what CI cannot install, so its outputs are committed. To rerun, in a scratch environment:

    python3 -m venv --system-site-packages /tmp/ref
    /tmp/ref/bin/pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 transformers==5.19.0
    /tmp/ref/bin/pip install openai loguru "datasets<=5.1.0" typer rich httpx aiohttp
    git clone https://github.com/deepseek-ai/DeepSpec /tmp/DeepSpec
    git clone https://github.com/z-lab/dflash /tmp/dflash
    PYTHONPATH=/tmp/DeepSpec:/tmp/dflash /tmp/ref/bin/python scripts/make_interop_fixtures.py

This script does not import DSpark: the references owe nothing to the code they check.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers

os.environ.setdefault("HF_HUB_OFFLINE", "1")
OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "interop"
TARGET = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=10000.0,
              tie_word_embeddings=False, rms_norm_eps=1e-6)
MASK = 3  # <|mask|> of the tokenizer the end-to-end test trains for this target
CONTEXTS = (5, 8)  # two requests: target features of positions 0..C-1, anchor at position C
TEMPERATURE = 0.8


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norms around 1), so that no term of the drafter can hide behind zeros or ones."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.dtype.is_floating_point:
                noise = torch.randn(param.shape, generator=generator)
                param.copy_(1 + 0.3 * noise if "norm" in name else 0.3 * noise)


def write_target(folder: Path) -> transformers.Qwen3ForCausalLM:
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TARGET)).eval()
    randomize(model, 0)
    model.save_pretrained(folder)
    return model


def inputs(features: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "features_0": rng.standard_normal((CONTEXTS[0], features)).astype(np.float32),
        "features_1": rng.standard_normal((CONTEXTS[1], features)).astype(np.float32),
        "anchors": rng.integers(4, 250, len(CONTEXTS)),
        "noise": rng.uniform(0.01, 0.99, (len(CONTEXTS), 8)).astype(np.float32),
    }


def draw(probs: torch.Tensor, u: float) -> int:
    cdf = probs.double().cumsum(-1)
    return min(int((cdf < u * cdf[-1]).sum()), probs.shape[-1] - 1)


def chain(step, gamma: int, anchor: int, noise, temperature: float, vocab: int, to_target) -> tuple[list, list]:
    """Draft γ tokens: `step(k, previous)` gives draft k's logits over the draft vocabulary."""
    tokens, probs, previous = [], [], anchor
    for k in range(gamma):
        logits = step(k, previous).float()
        if temperature == 0:
            index = int(logits.argmax())
            prob = torch.nn.functional.one_hot(torch.tensor(index), logits.shape[-1]).float()
        else:
            prob = torch.softmax(logits / temperature, -1)
            index = draw(prob, float(noise[k]))
        token = to_target(index)
        full = torch.zeros(vocab)
        full[to_target(torch.arange(logits.shape[-1]))] = prob
        tokens.append(token)
        probs.append(full.numpy())
        previous = token
    return tokens, probs


def save_reference(folder: Path, data: dict, outputs: dict) -> None:
    np.savez_compressed(folder / "reference.npz", **data, **{k: np.asarray(v) for k, v in outputs.items()})


def record(folder: Path, data: dict, gamma: int, run) -> None:
    """`run(request, temperature)` -> (tokens, probs, confidence logits or None) for one request."""
    outputs: dict[str, list] = {}
    for temperature, tag in ((0.0, "greedy"), (TEMPERATURE, "sampled")):
        for request in range(len(CONTEXTS)):
            tokens, probs, confidence = run(request, temperature)
            outputs.setdefault(f"{tag}_tokens", []).append(tokens)
            outputs.setdefault(f"{tag}_probs", []).append(probs)
            if confidence is not None:
                outputs.setdefault(f"{tag}_confidence", []).append(confidence)
    outputs["gamma"] = gamma
    outputs["temperature"] = TEMPERATURE
    save_reference(folder, data, outputs)


# DeepSpec: deepspec.modeling.dspark.qwen3.Qwen3DSparkModel (anchor-first block, own embedding and LM head)

def deepspec_case(out: Path, target, name: str, head: str, layer_ids: list[int], confidence: str, rank: int,
                  copy_target_embeddings: bool, seed: int) -> None:
    """`confidence`: "markov" (the head reads W1[previous] too), "plain" (hidden state only) or "none"."""
    from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel
    from deepspec.modeling.dspark.qwen3.config import build_draft_config

    args = dict(
        num_draft_layers=2,
        target_layer_ids=layer_ids,
        block_size=4,
        mask_token_id=MASK,
        num_anchors=8,
        confidence_head_alpha=0.0 if confidence == "none" else 1.0,
        confidence_head_with_markov=confidence == "markov",
        markov_rank=rank,
        markov_head_type=head,
    )
    config = build_draft_config(target.config, _Args(args))
    config._attn_implementation = "eager"
    model = Qwen3DSparkModel(config).eval()
    randomize(model, seed)
    if copy_target_embeddings:  # what DeepSpec's trainer does: frozen copies of the target's
        model.initialize_embeddings_and_head(embed_tokens=target.model.embed_tokens, lm_head=target.lm_head)
    folder = out / name
    model.save_pretrained(folder)
    data = inputs(len(layer_ids) * TARGET["hidden_size"], seed)
    gamma = config.block_size

    @torch.no_grad()
    def run(request: int, temperature: float):
        features = torch.from_numpy(data[f"features_{request}"])[None]
        context, anchor = features.shape[1], int(data["anchors"][request])
        ids = torch.tensor([[anchor] + [MASK] * (gamma - 1)])
        hidden = model._forward_backbone(position_ids=torch.arange(context + gamma)[None], attention_mask=None,
                                         noise_embedding=model.embed_tokens(ids), target_hidden_states=features,
                                         is_causal=False)
        base = model.compute_logits(hidden)[0]
        state = {"rnn": torch.zeros(1, rank)}

        def step(k: int, previous: int) -> torch.Tensor:
            prev = torch.tensor([previous])
            if model.markov_head is None:
                return base[k]
            if head == "rnn":
                state["rnn"], bias = model.markov_head._rnn_step(
                    state["rnn"], model.markov_head.get_prev_embeddings(prev), hidden[:, k]
                )
                return base[k] + bias[0]
            return model.markov_head.apply_step_logits(base[k][None], token_ids=prev, hidden_states=hidden[:, k])[0]

        tokens, probs = chain(
            step, gamma, anchor, data["noise"][request], temperature, TARGET["vocab_size"], lambda i: i
        )
        if temperature == 0 and model.markov_head is not None:  # DeepSpec's own greedy sampler agrees
            own, _ = model.sample_draft_tokens(base[None], first_prev_token_ids=torch.tensor([anchor]), temperature=0.0,
                                               hidden_states=hidden)
            assert own[0].tolist() == tokens, (own, tokens)
        previous = torch.tensor([[anchor] + tokens[:-1]])
        logits = model.predict_confidence_step(hidden, prev_token_ids=previous)
        return tokens, probs, None if logits is None else logits[0].numpy()

    record(folder, data, gamma, run)


class _Args(dict):
    """DeepSpec reads model arguments by attribute and tests membership with `in`."""

    __getattr__ = dict.__getitem__


# speculators 0.9.0: speculators.models.dspark / dflash (target embedding; 1+N or anchor-first; d2t vocabularies)

def speculators_case(out: Path, target, name: str, kind: str, layer_ids: list[int], sample_from_anchor: bool,
                     head: str, draft_vocab: int | None, seed: int) -> None:
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    layer_config = transformers.Qwen3Config(**(TARGET | {"num_hidden_layers": 2}))
    layer_config._attn_implementation = "eager"
    block = 4
    gamma = block if sample_from_anchor else block - 1
    vocab = draft_vocab or TARGET["vocab_size"]
    common = dict(
        transformer_layer_config=layer_config, draft_vocab_size=vocab, block_size=block,
        aux_hidden_state_layer_ids=layer_ids, mask_token_id=MASK, sample_from_anchor=sample_from_anchor,
        speculators_config=SpeculatorsConfig(
            algorithm=kind, proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=gamma)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(out / "target"), architectures=["Qwen3ForCausalLM"])))
    if kind == "dspark":
        config = DSparkSpeculatorConfig(**common, markov_rank=16, markov_head_type=head, enable_confidence_head=True,
                                        confidence_head_with_markov=True)
        model = DSparkDraftModel(config)
    else:
        model = DFlashDraftModel(DFlashSpeculatorConfig(**common))
    model.eval()
    randomize(model, seed)
    with torch.no_grad():  # the verifier's tensors, as `load_verifier_weights` fills them
        model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        if draft_vocab is None:
            model.lm_head.weight.copy_(target.lm_head.weight)
        else:
            generator = torch.Generator().manual_seed(seed)  # tokens, not padding rows (a tokenizer of ~260 tokens)
            selected = torch.sort(torch.randperm(256, generator=generator)[:vocab]).values
            t2d = torch.zeros(TARGET["vocab_size"], dtype=torch.bool)
            t2d[selected] = True
            model.load_vocab_mappings(t2d, selected - torch.arange(vocab))
    folder = out / name
    model.save_pretrained(folder)
    (folder / "config.py").unlink()  # its copy of speculators' source, for `trust_remote_code` loaders
    config_file = folder / "config.json"
    raw = json.loads(config_file.read_text())
    raw.pop("auto_map")
    raw["speculators_config"]["verifier"]["name_or_path"] = "Qwen/Qwen3-tiny"  # not this machine's path
    config_file.write_text(json.dumps(raw, indent=2) + "\n")
    data = inputs(len(layer_ids) * TARGET["hidden_size"], seed)
    d2t = None if draft_vocab is None else model.d2t.clone()
    to_target = (
        (lambda i: i) if d2t is None else (lambda i: (i + d2t[i]).tolist() if torch.is_tensor(i) else i + int(d2t[i]))
    )

    @torch.no_grad()
    def run(request: int, temperature: float):
        features = torch.from_numpy(data[f"features_{request}"])[None]
        context, anchor = features.shape[1], int(data["anchors"][request])
        ids = torch.tensor([[anchor] + [MASK] * (block - 1)])
        positions = torch.arange(context + block)[None]
        x, fused = model.embed_tokens(ids), model.hidden_norm(model.fc(features))
        rope = model.rotary_emb(x, positions)
        for layer in model.layers:
            x = layer(hidden_states=x, target_hidden=fused, attention_mask=None, position_ids=positions,
                      position_embeddings=rope)
        hidden = model.norm(x)  # [1, block, H]
        base = model.lm_head(hidden)[0]
        lead = block - gamma
        previous_rows = [anchor] * block  # row j's previous token: the anchor, then the drafts so far

        def step(k: int, previous: int) -> torch.Tensor:
            row = lead + k
            previous_rows[row] = previous
            if kind != "dspark":
                return base[row]
            bias = model.markov_head.block_bias(prev_token_ids=torch.tensor([previous_rows]), hidden_states=hidden)
            return base[row] + bias[0, row]

        tokens, probs = chain(step, gamma, anchor, data["noise"][request], temperature, TARGET["vocab_size"], to_target)
        if kind != "dspark":
            return tokens, probs, None
        previous_rows[lead:] = [anchor] + tokens[:-1]
        prev = model.markov_head.prev_embeddings(torch.tensor([previous_rows]))
        confidence = model.confidence_head(torch.cat([hidden, prev], -1))[0, lead:]
        return tokens, probs, confidence.numpy()

    record(folder, data, gamma, run)


# z-lab DFlash: dflash.model.DFlashDraftModel (1+N block; the target's embedding and LM head, not stored)

def zlab_case(out: Path, target, name: str, layer_ids: list[int], seed: int) -> None:
    from dflash.model import DFlashDraftModel

    block = 4
    config = transformers.Qwen3Config(**(TARGET | {"num_hidden_layers": 2}))
    config.architectures = ["DFlashDraftModel"]
    config.block_size = block
    config.num_target_layers = TARGET["num_hidden_layers"]
    config.dflash_config = {"target_layer_ids": layer_ids, "mask_token_id": MASK}
    model = DFlashDraftModel(config).eval()
    randomize(model, seed)
    folder = out / name
    model.save_pretrained(folder)
    data = inputs(len(layer_ids) * TARGET["hidden_size"], seed)

    @torch.no_grad()
    def run(request: int, temperature: float):
        features = torch.from_numpy(data[f"features_{request}"])[None]
        context, anchor = features.shape[1], int(data["anchors"][request])
        ids = torch.tensor([[anchor] + [MASK] * (block - 1)])
        hidden = model(position_ids=torch.arange(context + block)[None], noise_embedding=target.model.embed_tokens(ids),
                       target_hidden=features, is_causal=False)[:, 1:]
        logits = target.lm_head(hidden)[0]  # as dflash_generate drafts
        return (*chain(lambda k, previous: logits[k], block - 1, anchor, data["noise"][request], temperature,
                       TARGET["vocab_size"], lambda i: i), None)

    record(folder, data, block - 1, run)


# EAGLE-3: speculators.models.eagle3 (Qwen3 or Llama layer, draft vocabulary); SpecForge's layout is the Llama
# one with the layer stored as `midlayer.*` (speculators' own converter maps one onto the other)

def eagle3_case(out: Path, target, name: str, base: str, layer_ids: list[int], draft_vocab: int, specforge: bool,
                norm_before_residual: bool, seed: int) -> None:
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    gamma = 4
    dims = TARGET | {"num_hidden_layers": 1}
    layer_config = transformers.Qwen3Config(**dims) if base == "qwen3" else transformers.LlamaConfig(**dims)
    layer_config._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=draft_vocab, norm_before_residual=norm_before_residual,
        eagle_aux_hidden_state_layer_ids=layer_ids,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=gamma)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(out / "target"), architectures=["Qwen3ForCausalLM"])))
    model = Eagle3DraftModel(config).eval()
    randomize(model, seed)
    generator = torch.Generator().manual_seed(seed)
    selected = torch.sort(torch.randperm(256, generator=generator)[:draft_vocab]).values
    t2d = torch.zeros(TARGET["vocab_size"], dtype=torch.bool)
    t2d[selected] = True
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    model.load_vocab_mappings(t2d, selected - torch.arange(draft_vocab))
    folder = out / name
    model.save_pretrained(folder)
    (folder / "config.py").unlink()
    config_file = folder / "config.json"
    raw = json.loads(config_file.read_text())
    raw.pop("auto_map")
    raw["speculators_config"]["verifier"]["name_or_path"] = "Qwen/Qwen3-tiny"
    if specforge:  # SpecForge: a Llama config of the draft layer, the layer's tensors under `midlayer.`
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "model.safetensors")
        save_file({k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}, folder / "model.safetensors",
                  metadata={"format": "pt"})
        raw = layer_config.to_dict() | {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab,
                                        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}
        raw.pop("_attn_implementation_autoset", None)
    config_file.write_text(json.dumps(raw, indent=2) + "\n")
    data = inputs(len(layer_ids) * TARGET["hidden_size"], seed)
    rng = np.random.default_rng(seed)
    for request, context in enumerate(CONTEXTS):  # entry t holds token x_{t+1}; the last one is the anchor
        data[f"context_ids_{request}"] = rng.integers(4, 250, context)
        data["anchors"][request] = data[f"context_ids_{request}"][-1]
    d2t = model.d2t.clone()
    to_target = lambda i: (i + d2t[i]).tolist() if torch.is_tensor(i) else i + int(d2t[i])  # noqa: E731
    layer = model.layers[0]

    @torch.no_grad()
    def run(request: int, temperature: float):
        hidden = model.fc(torch.from_numpy(data[f"features_{request}"])[None])  # step-0 hidden of every entry
        tokens = torch.from_numpy(data[f"context_ids_{request}"])[None]
        drafted, probs = [], []
        for step in range(gamma):  # each step reruns the causal layer over [context entries; chain so far]
            x = torch.cat([model.embed_tokens(tokens), hidden], -1)
            length = x.shape[1]
            positions = 1 + torch.arange(length)[None]  # speculators counts entry positions from 1
            mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
            out = layer(x, attention_mask=mask, position_ids=positions,
                        position_embeddings=model.rotary_emb(x, positions))
            logits = model.lm_head(model.norm(out[:, -1]))[0]
            token, prob = chain(lambda k, previous: logits, 1, 0, data["noise"][request][step:], temperature,
                                TARGET["vocab_size"], to_target)
            drafted += token
            probs += prob
            tokens = torch.cat([tokens, torch.tensor([token])], 1)
            hidden = torch.cat([hidden, out[:, -1:]], 1)
        return drafted, probs, None

    record(folder, data, gamma, run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    out = parser.parse_args().out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    target = write_target(out / "target")
    deepspec_case(out, target, "deepspec-vanilla", "vanilla", [1, 2], "markov", 16, copy_target_embeddings=True, seed=1)
    deepspec_case(out, target, "deepspec-gated", "gated", [-1, 3], "markov", 16, copy_target_embeddings=False, seed=2)
    deepspec_case(out, target, "deepspec-rnn", "rnn", [0, 2], "markov", 16, copy_target_embeddings=False, seed=3)
    deepspec_case(
        out, target, "deepspec-confidence-alone", "vanilla", [1, 3], "plain", 16, copy_target_embeddings=True, seed=4
    )
    deepspec_case(out, target, "deepspec-dflash", "vanilla", [1, 2], "none", 0, copy_target_embeddings=True, seed=5)
    speculators_case(out, target, "speculators-dspark", "dspark", [2, 4], True, "gated", None, seed=6)
    speculators_case(out, target, "speculators-dspark-1n-pruned", "dspark", [1, 3], False, "rnn", 48, seed=7)
    speculators_case(out, target, "speculators-dflash", "dflash", [1, 3], False, "vanilla", None, seed=8)
    zlab_case(out, target, "zlab-dflash", [1, 2], seed=9)
    eagle3_case(out, target, "speculators-eagle3", "qwen3", [1, 2, 4], 64, False, True, seed=10)
    eagle3_case(out, target, "specforge-eagle3", "llama", [2, 3, 4], 40, True, False, seed=11)
    sizes = {p.name: sum(f.stat().st_size for f in p.iterdir()) for p in sorted(out.iterdir())}
    print(json.dumps(sizes, indent=1))


if __name__ == "__main__":
    main()
