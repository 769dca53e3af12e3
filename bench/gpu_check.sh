#!/usr/bin/env bash
# The GPU check (issue #14 item 7): one run on one CUDA GPU, under 8 minutes, one table. bench.step bf16 eager and
# compiled at MiniMind-26M and MiniMind-104M (tokens/s, MFU); fp16 with the GradScaler; the Trainer in-process and
# the 1-GPU Ray job (prepare the demo corpus, train, --exit-after-steps, resume, export, sample) against
# bench.step; the Ray Data stream's delivery rate on the CPUs. What each part runs: bench/gpu_check.py.
#
#   bash bench/gpu_check.sh                 # on the GPU machine
#   bash bench/gpu_check.sh --device cpu    # dry run: tiny configs through the same commands (minutes on 2 cores)
#
# Python: $PYTHON, else .venv/bin/python, else python3. It needs torch (a CUDA build for the GPU run), numpy and
# safetensors; the Ray parts also need ray[train,data] >= 2.60, pyarrow, tokenizers and pyyaml, and are skipped,
# with one line saying so, without them. Every part has a hard time limit inside a budget of 440 s (the dry run:
# 1500 s), and `timeout` stops the whole at 480 s. Results: bench/results/gpu/gpu_check.json and logs/ (or
# $MINILM_BENCH_RESULTS).
set -euo pipefail

device=cuda
while [ $# -gt 0 ]; do
    case "$1" in
        --device) device="${2:?--device needs cpu or cuda}"; shift 2 ;;
        --device=*) device="${1#--device=}"; shift ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "error: bench/gpu_check.sh: unknown argument $1 (only --device cpu|cuda)" >&2; exit 2 ;;
    esac
done
case "$device" in
    cuda) budget=440; limit=480 ;;
    cpu) budget=1500; limit=1560 ;;
    *) echo "error: bench/gpu_check.sh: --device must be cpu or cuda, got $device" >&2; exit 2 ;;
esac

cd "$(dirname "$0")/.."
python="${PYTHON:-}"
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the repo's packages, installed or not
export MINILM_BENCH_RESULTS="${MINILM_BENCH_RESULTS:-bench/results/gpu}"
"$python" - <<'PY'
import importlib.util, sys
missing = [m for m in ("torch", "numpy", "safetensors") if importlib.util.find_spec(m) is None]
if missing:
    print(f"error: bench/gpu_check.sh: {sys.executable} lacks {', '.join(missing)}; install torch (a CUDA build), "
          f"numpy and safetensors for it, or set PYTHON", file=sys.stderr)
    sys.exit(2)
PY
exec timeout --kill-after=20 "$limit" "$python" -m bench.gpu_check --device "$device" --budget "$budget"
