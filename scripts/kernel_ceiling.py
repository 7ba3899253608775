"""What a target step of M tokens costs in each CPU weight format on this machine, beside the hardware's limits.

    python scripts/kernel_ceiling.py --shape qwen3-1.7b --rows 1,2,4,8,16

The formats' own products on a chain of the target's decoder layers with random weights (q/k/v, o, gate/up, down;
no attention or norms, alike in every format), at least 2^28 weights and twice the last-level cache, formats and
row counts interleaved round by round, medians, scaled by weight count to a whole target step (layers and LM head)
(`dspark_export.weight_choice.probe`, what `--weights auto` measures): int4 (ONNX Runtime's `MatMulNBits`), w8a8
(per-row int8 -> `MatMulInteger`) and w4a8 (DSpark's own `Int4RowsMatMul`, runtime/dspark_common/native). The
limits: int4 bytes (and a float16 scale per 32) over the bandwidth all threads read a 1 GiB buffer at, and the
products over the vpmaddubsw rate of all cores (32 int8 products an instruction, nothing else issued), from
`cpu_limits.c` compiled here with the system's C compiler.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

LIMITS_SOURCE = Path(__file__).with_name("cpu_limits.c")


def cpu_limits(threads: int) -> tuple[float, float]:
    """(bytes a second all threads read, int8 products a second of `threads` cores)."""
    with tempfile.TemporaryDirectory(prefix="dspark-limits-") as scratch:
        library = Path(scratch) / "cpu_limits.so"
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-mavx2", "-fopenmp", "-shared", "-fPIC", str(LIMITS_SOURCE),
                        "-o", str(library)], check=True)
        lib = ctypes.CDLL(str(library))
        lib.read_rate.restype, lib.read_rate.argtypes = ctypes.c_double, [ctypes.c_void_p, ctypes.c_size_t]
        lib.products_per_second.restype, lib.products_per_second.argtypes = ctypes.c_double, [ctypes.c_long]
        buffer = np.ones(1 << 30, np.uint8)
        bandwidth = float(np.median([lib.read_rate(buffer.ctypes.data, buffer.nbytes) for _ in range(5)]))
        products = float(np.median([lib.products_per_second(100_000_000) for _ in range(3)]))
    return bandwidth, products * threads


def cpu_name() -> str:
    """The CPU's model name and the vector flags that matter here."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")
    return f"{name} ({' '.join(flag for flag in wanted if flag in flags) or 'no AVX2'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-1.7b", help="a preset target shape (dspark_export.presets)")
    parser.add_argument("--rows", default="1,2,4,8,16", help="comma-separated row counts M")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads (ONNX Runtime's, the limits')")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    from dspark_export.presets import PRESETS
    from dspark_export.weight_choice import cpu_format, layer_weights, probe, probe_layers

    config = PRESETS[args.shape][1]
    rows = [int(r) for r in args.rows.split(",")]
    per_weight = probe(config, [cpu_format(name) for name in ("int4", "w8a8", "w4a8")], rows, args.threads)
    bandwidth, products = cpu_limits(args.threads)
    step = config.num_hidden_layers * layer_weights(config) + config.vocab_size * config.hidden_size
    read_floor = step * (0.5 + 2 / 32) / bandwidth
    print(f"{args.shape}: {step / 1e9:.2f} G weights a step; {cpu_name()}; {args.threads} threads; timed on "
          f"{probe_layers(config)} layers")
    print(f"limits: reads {bandwidth / 1e9:.1f} GB/s (an int4 step {read_floor * 1e3:.1f} ms); vpmaddubsw "
          f"{products / 1e9:.0f} G int8 products/s ({step / products * 1e3:.1f} ms a row)")
    print("| M | " + " | ".join(per_weight) + " | limit |")
    print("|---|" + "---|" * (len(per_weight) + 1))
    for m in rows:
        cells = [f"{t[m] * step * 1e3:.1f} ms ({t[m] / t[rows[0]]:.2f}x)" for t in per_weight.values()]
        print(f"| {m} | " + " | ".join(cells) + f" | {max(read_floor, m * step / products) * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
