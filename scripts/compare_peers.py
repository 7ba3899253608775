"""DSpark against CPU peers on the same checkpoint, the same prompts, in one process.

    python scripts/compare_peers.py [ENGINE_DIR] --domains code --limit 10 --max-tokens 128 --spec fixed:4
    python scripts/compare_peers.py --peers transformers,llama.cpp --llama-cpp-source VENDOR/llama.cpp

Greedy decoding, one request at a time, `--threads` threads for everyone. For each prompt every peer and
the DSpark engine (`off` and `--spec`) generate `--max-tokens` tokens from the same token ids (prefill
included in the time); medians of tokens/s and the ratios are printed, and greedy outputs are compared.

Peers (not part of the test suite):
- `transformers`: `generate()`, eager, fp32. Needs torch and transformers (`pip install -e ".[export,test]"`).
- `llama.cpp`: llama-cpp-python on the checkpoint converted to GGUF (`--gguf-type f32` or `bf16`, the
  checkpoint's own precision) by llama.cpp's `convert_hf_to_gguf.py`. Needs `pip install llama-cpp-python
  gguf sentencepiece` (it compiles llama.cpp from the sdist, about 10 minutes on 2 cores) and the converter,
  which only the sdist has: `pip download --no-deps --no-binary :all: llama-cpp-python`, unpack it, and pass
  its `vendor/llama.cpp` as `--llama-cpp-source`. The demo's tokenizer is a byte-level BPE with the GPT-2
  split pattern, which the converter does not know by hash, so it is told so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

Generate = Callable[[list[int]], list[int]]

CONVERT = """
import runpy, sys
source = sys.argv[1]
sys.path[:0] = [source, source + "/gguf-py"]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(source + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def transformers_peer(model_dir: Path, max_tokens: int, threads: int) -> Generate:
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    def generate(ids: list[int]) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
        return out[0, len(ids):].tolist()

    return generate


def llama_cpp_peer(model_dir: Path, max_tokens: int, threads: int, source: Path, gguf_type: str, work: Path) -> Generate:
    import llama_cpp

    gguf = work / f"{model_dir.name}-{gguf_type}.gguf"
    if not gguf.is_file():
        subprocess.run([sys.executable, "-c", CONVERT, str(source), str(model_dir), "--outfile", str(gguf),
                        "--outtype", gguf_type], check=True, capture_output=True)
    context = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    llm = llama_cpp.Llama(str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False)

    def generate(ids: list[int]) -> list[int]:
        tokens = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(int(token))
            if len(tokens) == max_tokens:
                break
        return tokens

    return generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine_dir", nargs="?", default=None)
    parser.add_argument("--domains", default="code", help="comma-separated prompt domains")
    parser.add_argument("--limit", type=int, default=10, help="prompts per domain")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--spec", default="fixed:4")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--peers", default="transformers", help="comma-separated: transformers, llama.cpp")
    parser.add_argument("--llama-cpp-source", type=Path, help="llama.cpp source folder holding convert_hf_to_gguf.py")
    parser.add_argument("--gguf-type", default="f32", choices=["f32", "bf16", "f16"])
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dspark-peers", help="where GGUF files go")
    args = parser.parse_args()

    from dspark_runtime.prompts import demo_prompts_path
    from dspark_export.presets import resolve_target
    from dspark_runtime import Engine, SamplingParams
    from dspark_runtime.prompts import read_prompts

    names = args.peers.split(",")
    if "llama.cpp" in names and args.llama_cpp_source is None:
        parser.error("the llama.cpp peer needs --llama-cpp-source (see the docstring)")
    args.work.mkdir(parents=True, exist_ok=True)
    rows = [r for r in read_prompts(demo_prompts_path(), args.limit) if r.get("domain") in args.domains.split(",")]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    with Engine.load(args.engine_dir, threads=args.threads) as engine:
        model_dir = resolve_target(engine.manifest.target_name, None).require_path()
        peers: dict[str, Generate] = {}
        for name in names:
            if name == "transformers":
                peers[name] = transformers_peer(model_dir, args.max_tokens, args.threads)
            elif name == "llama.cpp":
                peers[f"llama.cpp-{args.gguf_type}"] = llama_cpp_peer(model_dir, args.max_tokens, args.threads,
                                                                      args.llama_cpp_source, args.gguf_type, args.work)
            else:
                parser.error(f"unknown peer {name!r}")
        for mode in ("off", args.spec):
            peers[mode] = lambda ids, mode=mode: engine.generate(ids, params, spec=mode).token_ids
        timings: dict[str, list[float]] = {name: [] for name in peers}
        agree = {name: 0 for name in peers}
        peers[args.spec](engine.tokenizer.encode(rows[0]["prompt"]))  # warm-up
        for row in rows:
            ids = engine.tokenizer.encode(row["prompt"])
            outputs = {}
            for name, generate in peers.items():
                started = time.perf_counter()
                outputs[name] = generate(ids)
                timings[name].append(len(outputs[name]) / (time.perf_counter() - started))
            for name in peers:
                agree[name] += outputs[name] == outputs["off"]
            print(f"{row['domain']:5s} " + "  ".join(f"{n} {t[-1]:6.1f}" for n, t in timings.items()) + " tok/s", flush=True)
    medians = {name: float(np.median(values)) for name, values in timings.items()}
    print(json.dumps({
        "prompts": len(rows), "domains": args.domains, "max_tokens": args.max_tokens, "threads": args.threads,
        "median_tokens_per_s": {k: round(v, 1) for k, v in medians.items()},
        "ratios": {f"{args.spec}_vs_off": round(medians[args.spec] / medians["off"], 2)}
        | {f"{mode}_vs_{name}": round(medians[mode] / medians[name], 2)
           for mode in ("off", args.spec) for name in medians if name not in ("off", args.spec)},
        "prompts_with_the_same_greedy_output_as_off": agree,
    }, indent=2))


if __name__ == "__main__":
    main()
