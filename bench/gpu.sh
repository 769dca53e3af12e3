#!/usr/bin/env bash
# The step benchmark on one H100/H200 GPU: hidden 768, 16 layers, seq 1024, bf16 autocast, dense and
# MoE (4 experts, top-1, same active parameters), eager and torch.compile'd, tokens/s and MFU against
# the bf16 matmul peak measured in the same process (8192^3). Estimated at 3-4 minutes with start-up
# and compilation (not yet run on a GPU); a hard limit stops the benchmark at 7 minutes.
#
#   bash bench/gpu.sh                  # on the GPU machine
#   bash bench/gpu.sh --device cpu     # dry run on a CPU: a tiny config, same code path (compilation
#                                      # dominates: seconds once inductor's disk cache is warm)
#
# Python: $PYTHON, else .venv/bin/python, else python3; it needs torch (CUDA build for the GPU run),
# numpy and safetensors. Results: bench/results/gpu/step.json (or $MINILM_BENCH_RESULTS).
set -euo pipefail

device=cuda
while [ $# -gt 0 ]; do
    case "$1" in
        --device) device="${2:?--device needs cpu or cuda}"; shift 2 ;;
        --device=*) device="${1#--device=}"; shift ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "bench/gpu.sh: unknown argument $1 (only --device cpu|cuda)" >&2; exit 2 ;;
    esac
done
case "$device" in cpu|cuda) ;; *) echo "bench/gpu.sh: --device must be cpu or cuda, got $device" >&2; exit 2 ;; esac

cd "$(dirname "$0")/.."
python="${PYTHON:-}"
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the repo's packages, installed or not
export MINILM_BENCH_RESULTS="${MINILM_BENCH_RESULTS:-bench/results/gpu}"
date
"$python" - "$device" <<'EOF'
import sys
try:
    import numpy, safetensors, torch  # noqa: F401  (what bench.step imports through minilm)
except ImportError as e:
    sys.exit(f"bench/gpu.sh: {e}; install torch, numpy and safetensors for this python")
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
if sys.argv[1] == "cuda":
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.sh: torch sees no CUDA device (a CPU-only torch build, or no GPU); "
                 "use --device cpu for a dry run")
    print(f"GPU: {torch.cuda.get_device_name(0)}, capability {torch.cuda.get_device_capability(0)}")
EOF

if [ "$device" = cuda ]; then
    # 16 x 1024 tokens per step; 5 warm-up steps per config absorb compilation and autotuning.
    args=(--device cuda --dtype bf16 --hidden-size 768 --num-hidden-layers 16 --seq-len 1024
          --micro-batch-size 16 --steps 20 --warmup 5 --compile)
    limit=420
else
    args=(--device cpu --dtype bf16 --hidden-size 64 --num-hidden-layers 2 --vocab-size 256 --seq-len 64
          --micro-batch-size 2 --steps 2 --warmup 2 --compile --peak-size 512)
    limit=600
fi
echo "+ $python -m bench.step ${args[*]}"
timeout "$limit" "$python" -m bench.step "${args[@]}"
