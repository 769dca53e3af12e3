#!/usr/bin/env bash
# The GPU check: one run on one CUDA GPU, under 8 minutes, one table (what each part runs: bench/gpu_check.py).
#
#   bash bench/gpu_check.sh --bundle gpu-bundle   # on the lent GPU machine: install the bundle, then the check
#   bash bench/gpu_check.sh                       # on a GPU machine that has Ray already
#   bash bench/gpu_check.sh --device cpu          # dry run: tiny configs through the same commands (minutes on 2 cores)
#
# --bundle DIR: the wheels bench/gpu_bundle.sh built (Ray and what it needs that the image lacks), installed first
# by DIR/install.sh, the lent machine's own install line (into $MINILM_BUNDLE_SITE, default /tmp/site).
# Python: $PYTHON, else .venv/bin/python, else python3. It needs torch (a CUDA build for the GPU run), numpy and
# safetensors; the Ray parts also need ray[train,data] >= 2.60, pyarrow, tokenizers and pyyaml, and are skipped,
# with one line saying so, without them. Every part has a hard time limit inside a budget of 440 s (the dry run:
# 1500 s), and `timeout` stops the whole at 480 s (its SIGTERM still writes the results). Results: three files in
# $OUT (the lent machine's output folder), else $MINILM_BENCH_RESULTS, else bench/results/gpu.
set -euo pipefail

device=cuda
bundle=
while [ $# -gt 0 ]; do
    case "$1" in
        --device) device="${2:?--device needs cpu or cuda}"; shift 2 ;;
        --device=*) device="${1#--device=}"; shift ;;
        --bundle) bundle="${2:?--bundle needs the bundle folder}"; shift 2 ;;
        --bundle=*) bundle="${1#--bundle=}"; shift ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "error: bench/gpu_check.sh: unknown argument $1 (only --device cpu|cuda, --bundle DIR)" >&2; exit 2 ;;
    esac
done
case "$device" in
    cuda) budget=440; limit=480 ;;
    cpu) budget=1500; limit=1560 ;;
    *) echo "error: bench/gpu_check.sh: --device must be cpu or cuda, got $device" >&2; exit 2 ;;
esac

if [ -n "$bundle" ]; then
    [ -d "$bundle" ] || { echo "error: bench/gpu_check.sh: --bundle: no folder $bundle" >&2; exit 2; }
    bundle="$(cd "$bundle" && pwd)"
    [ -f "$bundle/install.sh" ] || { echo "error: bench/gpu_check.sh: --bundle: $bundle has no install.sh (build it with bench/gpu_bundle.sh)" >&2; exit 2; }
fi
cd "$(dirname "$0")/.."
python="${PYTHON:-}"
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
if [ -n "$bundle" ]; then
    # shellcheck source=/dev/null
    PYTHON="$python" . "$bundle/install.sh" || { echo "error: bench/gpu_check.sh: installing the bundle $bundle failed (its pip output above)" >&2; exit 2; }
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the repo's packages, installed or not
"$python" - <<'PY'
import importlib.util, sys
missing = [m for m in ("torch", "numpy", "safetensors") if importlib.util.find_spec(m) is None]
if missing:
    print(f"error: bench/gpu_check.sh: {sys.executable} lacks {', '.join(missing)}; install torch (a CUDA build), "
          f"numpy and safetensors for it, or set PYTHON", file=sys.stderr)
    sys.exit(2)
PY
exec timeout --kill-after=20 "$limit" "$python" -m bench.gpu_check --device "$device" --budget "$budget"
