"""A mutation fuzzer for GGUF files: broken variants of one valid file, each made by editing the bytes where a
field, an array count or a tensor's entry lies (found by its key or name), and a runner that puts each through
`dspark-export inspect` and `build` in this process under a memory limit and a deadline per command, reporting
what happened as JSON lines (`python -m tests.gguf_fuzz FILE WORK`)."""

from __future__ import annotations

import json
import math
import resource
import signal
import struct
import sys
import time
from pathlib import Path

MEMORY_LIMIT = 2 << 30  # bytes of address space the runner may use
DEADLINE = 30  # seconds a command may take


def _after(data: bytes, key: bytes) -> int:
    """Where the bytes after a length-prefixed `key` (a metadata key or a tensor name) begin."""
    at = data.index(struct.pack("<Q", len(key)) + key)
    return at + 8 + len(key)


def _put(data: bytes, at: int, fmt: str, value) -> bytes:
    return data[:at] + struct.pack(fmt, value) + data[at + struct.calcsize(fmt):]


def _value(data: bytes, key: str, fmt: str, value) -> bytes:
    """Metadata `key`'s scalar value replaced (its type kept)."""
    return _put(data, _after(data, key.encode()) + 4, fmt, value)


def _tensor(data: bytes, name: str, part: str, value) -> bytes:
    """A field of tensor `name`'s entry replaced: "dims" (the count), "dim0", "type" or "offset"."""
    at = _after(data, name.encode())
    dims = struct.unpack_from("<I", data, at)[0]
    where = {"dims": (at, "<I"), "dim0": (at + 4, "<Q"), "type": (at + 4 + 8 * dims, "<I"),
             "offset": (at + 8 + 8 * dims, "<Q")}[part]
    return _put(data, *where, value)


def _same_length_tokens(data: bytes) -> tuple[int, int, int]:
    """Two different tokens of the same length in the token list: (start of the first, of the second, length)."""
    at = _after(data, b"tokenizer.ggml.tokens") + 4 + 4 + 8
    seen = {}
    while True:
        length = struct.unpack_from("<Q", data, at)[0]
        if length in seen and data[seen[length] : seen[length] + length] != data[at + 8 : at + 8 + length]:
            return seen[length], at + 8, length
        seen.setdefault(length, at + 8)
        at += 8 + length


def mutants(data: bytes) -> dict[str, bytes]:
    """Broken variants of a valid Qwen3 GGUF file, by name."""
    found = {}
    for fraction in (0.0, 0.001, 0.01, 0.5, 0.999):
        found[f"truncated at {fraction}"] = data[: max(8, int(len(data) * fraction))]
    found["wrong magic"] = b"GGUG" + data[4:]
    for version in (1, 4):
        found[f"version {version}"] = _put(data, 4, "<I", version)
    for count in (0, 1, 1 << 40):
        found[f"tensor count {count}"] = _put(data, 8, "<Q", count)
    for count in (0, 1 << 40, (1 << 64) - 1):
        found[f"metadata count {count}"] = _put(data, 16, "<Q", count)
    found["first key 2^40 long"] = _put(data, 24, "<Q", 1 << 40)
    tokens = _after(data, b"tokenizer.ggml.tokens")
    for count in (5, 1 << 40, 1 << 62):
        found[f"token array of {count}"] = _put(data, tokens + 8, "<Q", count)
    for element in (9, 13):
        found[f"token array of type {element}"] = _put(data, tokens + 4, "<I", element)
    for kind in (8, 6, 9):
        found[f"block count of type {kind}"] = _put(data, _after(data, b"qwen3.block_count"), "<I", kind)
    for value in (0, 1, 10**9, (1 << 32) - 1):
        found[f"block count {value}"] = _value(data, "qwen3.block_count", "<I", value)
    for value in (0, 7):
        found[f"head count {value}"] = _value(data, "qwen3.attention.head_count", "<I", value)
    for value in (0, 4):
        found[f"kv head count {value}"] = _value(data, "qwen3.attention.head_count_kv", "<I", value)
    for value in (math.nan, -1.0, math.inf, 0.0):
        found[f"rms epsilon {value}"] = _value(data, "qwen3.attention.layer_norm_rms_epsilon", "<f", value)
        found[f"rope theta {value}"] = _value(data, "qwen3.rope.freq_base", "<f", value)
    found["context length 0"] = _value(data, "qwen3.context_length", "<I", 0)
    for value in (8192, (1 << 32) - 1):
        found[f"end token {value}"] = _value(data, "tokenizer.ggml.eos_token_id", "<I", value)
    architecture = _after(data, b"general.architecture") + 4 + 8
    found["llama keys in a qwen3 file"] = data[:architecture] + b"llama" + data[architecture + 5:]
    found["token types one short"] = _put(data, _after(data, b"tokenizer.ggml.token_type") + 8, "<Q", 8191)
    first, second, length = _same_length_tokens(data)
    found["a token twice"] = data[:second] + data[first : first + length] + data[second + length:]
    found["a token not UTF-8"] = data[:first] + b"\xff" + data[first + 1:]
    for kind in (3, 9, 24, 99):
        found[f"embedding of ggml type {kind}"] = _tensor(data, "token_embd.weight", "type", kind)
    found["a norm stored as I32"] = _tensor(data, "blk.0.attn_norm.weight", "type", 26)
    for offset in (1, (1 << 64) - 1, 1 << 63):
        found[f"embedding at offset {offset}"] = _tensor(data, "token_embd.weight", "offset", offset)
    found["two tensors at offset 0"] = _tensor(_tensor(data, "token_embd.weight", "offset", 0), "output_norm.weight",
                                               "offset", 0)
    for value in (0, 1 << 40, 383):
        found[f"embedding rows of {value}"] = _tensor(data, "token_embd.weight", "dim0", value)
    for dims in (0, 9):
        found[f"embedding of {dims} dimensions"] = _tensor(data, "token_embd.weight", "dims", dims)
    return found


def run(file: Path, work: Path) -> None:
    """Each mutant of `file` through inspect and build; one JSON line per command."""
    from click.testing import CliRunner

    from dspark_export.cli import main

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    def expired(*_):
        raise TimeoutError(f"over {DEADLINE} s")

    signal.signal(signal.SIGALRM, expired)
    for index, (name, data) in enumerate(mutants(file.read_bytes()).items()):
        path = work / f"mutant-{index}.gguf"
        path.write_bytes(data)
        out = work / f"engine-{index}"
        for command in (["inspect", str(path)], ["build", "--target-path", str(path), "--no-drafter", "--out",
                                                  str(out)]):
            started = time.perf_counter()
            signal.alarm(DEADLINE)
            try:
                result = CliRunner().invoke(main, command)
                code, output = result.exit_code, result.output
                crash = None if isinstance(result.exception, SystemExit) or result.exception is None else \
                    f"{type(result.exception).__name__}: {result.exception}"
            except BaseException as exc:  # noqa: BLE001  (a deadline, or memory, counts against the file)
                code, output, crash = None, "", f"{type(exc).__name__}: {exc}"
            finally:
                signal.alarm(0)
            print(json.dumps({"mutant": name, "command": command[0], "code": code, "output": output, "crash": crash,
                              "seconds": time.perf_counter() - started, "wrote": out.exists()}), flush=True)
        path.unlink()


if __name__ == "__main__":
    run(Path(sys.argv[1]), Path(sys.argv[2]))
