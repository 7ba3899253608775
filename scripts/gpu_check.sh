#!/usr/bin/env bash
# Check the varlen-verification Triton kernel on this machine's GPU (needs torch with CUDA and Triton).
# Usage: scripts/gpu_check.sh [--dtype bfloat16|float16|float32] [--repeats N]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python3 -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device visible to torch'" \
  || { echo "gpu_check: needs an NVIDIA GPU with torch (CUDA build) and triton installed" >&2; exit 2; }
# plugins/ holds the dspark_plugins package: importable from there without installing DSpark
PYTHONPATH="$root/plugins${PYTHONPATH:+:$PYTHONPATH}" timeout 300 python3 "$root/scripts/gpu_check.py" "$@"
