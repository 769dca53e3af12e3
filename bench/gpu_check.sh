#!/usr/bin/env bash
# The GPU check: one command on one CUDA GPU, within the lent machine's 10 minutes, one table (bench/gpu_check.py).
#
#   bash bench/gpu_check.sh --bundle gpu-bundle   # on the lent GPU machine: install the bundle, then the check
#   bash bench/gpu_check.sh --bundle gpu-bundle --only step-104m-compiled,ray-job   # a rerun of what was left
#   bash bench/gpu_check.sh --plan                # the plan alone: the parts in order, their limits, the total
#   bash bench/gpu_check.sh --device cpu          # dry run: tiny configs through the same commands (minutes on 2 cores)
#
# --bundle DIR: the wheels bench/gpu_bundle.sh built (Ray and what it needs that the image lacks), installed first
# by DIR/install.sh, the lent machine's own install line (into $MINILM_BUNDLE_SITE, default /tmp/site); make
# gpu-bundle builds and verifies it. Without it the check still runs, the Ray parts skipped, the results saying why.
# Python: $PYTHON, else .venv/bin/python, else python3. It needs torch (a CUDA build for the GPU run), numpy and
# safetensors; the Ray parts also need ray[train,data] >= 2.60, pyarrow, tokenizers and pyyaml, and are skipped,
# with one line saying so, without them. The whole command stays within $MINILM_COMMAND_S (600 s on the GPU, the
# lent machine's limit; 2460 s for the dry run, a cap): what the install leaves, less 10 s, is `timeout`'s limit (its
# SIGTERM still writes the results), and 30 s less again the check's budget, which its plan fits with 20% to spare.
# Results: three files in $OUT (the lent machine's output folder), else $MINILM_BENCH_RESULTS, else bench/results/gpu.
set -euo pipefail
start=$SECONDS

device=cuda
bundle=
extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --device) device="${2:?--device needs cpu or cuda}"; shift 2 ;;
        --device=*) device="${1#--device=}"; shift ;;
        --bundle) bundle="${2:?--bundle needs the bundle folder}"; shift 2 ;;
        --bundle=*) bundle="${1#--bundle=}"; shift ;;
        --only) extra+=(--only "${2:?--only needs part names}"); shift 2 ;;
        --only=*) extra+=("$1"); shift ;;
        --plan) extra+=(--plan); shift ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        *) echo "error: bench/gpu_check.sh: unknown argument $1 (only --device cpu|cuda, --bundle DIR, --only PARTS, --plan)" >&2; exit 2 ;;
    esac
done
case "$device" in
    cuda) command_s=${MINILM_COMMAND_S:-600} ;;
    cpu) command_s=${MINILM_COMMAND_S:-2460} ;;
    *) echo "error: bench/gpu_check.sh: --device must be cpu or cuda, got $device" >&2; exit 2 ;;
esac

# A bundle that is missing or does not install is one error line, and the check still runs every part that needs
# no bundle, its result files saying why the rest were skipped (a lent call is not to be lost to it).
bundle_error=
if [ -n "$bundle" ]; then
    if [ ! -d "$bundle" ]; then
        bundle_error="--bundle: no folder $bundle"
    elif [ ! -f "$bundle/install.sh" ]; then
        bundle_error="--bundle: $bundle has no install.sh (build it with make gpu-bundle)"
    else
        bundle="$(cd "$bundle" && pwd)"
    fi
fi
cd "$(dirname "$0")/.."
python="${PYTHON:-}"
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
bundle_flags=()
if [ -n "$bundle" ] && [ -z "$bundle_error" ]; then
    # shellcheck source=/dev/null
    if PYTHON="$python" . "$bundle/install.sh"; then
        echo "# bundle installed in $((SECONDS - start)) s"
        bundle_flags=("--bundle=$bundle")
    else
        bundle_error="installing the bundle $bundle failed (its pip output above)"
    fi
fi
if [ -n "$bundle_error" ]; then
    echo "error: bench/gpu_check.sh: $bundle_error" >&2
    bundle_flags=("--bundle-error=$bundle_error")
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
limit=$((command_s - (SECONDS - start) - 10))
budget=$((limit - 30))
exec timeout --kill-after=8 "$limit" "$python" -m bench.gpu_check --device "$device" --budget "$budget" \
    "${bundle_flags[@]}" "${extra[@]}"
