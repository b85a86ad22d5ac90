#!/usr/bin/env bash
# The GPU check in one command (`make gpu-check`), for a lent GPU machine: no network, Python 3.12 with torch and
# CUDA, 15 minutes of device time all tries together. Prepared here: `make gpu-wheels` puts what its image lacks
# into .whl/ (benchmarks/gpu/wheels.txt; tests/checks/test_gpu_wheels.py keeps the list whole), which travels with
# the working tree (the device tool's `carry: [".whl"]`). Everything it writes goes to $OUT, at most 8 files.
#
#   1. the CUDA test subset: the oracle (staggered joins and a cancelled stream, exact against transformers'
#      generate() in float32 on the same GPU) on Llama, Qwen3 and Gemma 2 checkpoints, bf16 through the server
#      within the bf16 tests' tolerance, speculative drafts, a LoRA adapter and structured output;
#   2. benchmarks/gpu_check.py: the serving figures on a ~1B bf16 Llama, the bare forward, transformers' own
#      generate(), the roofline and the launch cost without CUDA graphs.
#
# DEVICE=cpu and PYTHON=... run the same steps here, to try the script itself (CI runs gpu_check.py --quick alone).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-check}
DEVICE=${DEVICE:-cuda}
PYTHON=${PYTHON:-python3}
SITE=${SITE:-/tmp/conveyor-gpu}
WHEELS=${WHEELS:-.whl}  # another folder, or none, to try the script where the Python is not 3.12
mkdir -p "$OUT" "$SITE"
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE/wheels" \
        "$WHEELS"/*.whl || exit 1
fi
"$PYTHON" benchmarks/gpu/layout.py "$SITE/src" > /dev/null || exit 1
# PYTHONSAFEPATH: no process puts its working folder first on its path, where conveyor/ (the common package
# alone) would hide the laid-out package.
export PYTHONSAFEPATH=1 PYTHONPATH="$SITE/src:$SITE/wheels:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CONVEYOR_TEST_DEVICE=$DEVICE
{ nvidia-smi 2>&1 || true; "$PYTHON" -c "import torch; print(torch.__version__, torch.cuda.is_available())"; } \
    > "$OUT/machine.txt" 2>&1

mapfile -t TESTS < <(grep -v '^#' benchmarks/gpu/tests.txt)
timeout 270 "$PYTHON" -m pytest -q -p no:cacheprovider --junitxml="$OUT/tests.xml" "${TESTS[@]}" > "$OUT/tests.log" 2>&1
tests=$?
QUICK=$([ "$DEVICE" = cpu ] && echo --quick)
timeout 300 "$PYTHON" -m benchmarks.gpu_check --device "$DEVICE" $QUICK --out "$OUT" > "$OUT/check.log" 2>&1
check=$?
echo "tests: exit $tests, gpu_check: exit $check (results in $OUT)"
[ "$tests" = 0 ] && [ "$check" = 0 ]
