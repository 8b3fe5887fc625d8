#!/usr/bin/env bash
# The engine's GPU checks in one device call (carrying wheelhouse/): engine / model / sampler
# GPU tests, the rest of the GPU suite but top-k, the main job in bf16 with "auto" and "fp8"
# caches, and bench_engine. Logs to $OUT.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
OUT=${OUT:-$root/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DEEPFUSE_COMMIT=$(cat wheelhouse/COMMIT 2>/dev/null || echo unknown)
whl=$(ls wheelhouse/deepfuse-*cp312*.whl | head -n1)
python3 -m pip install -q --no-deps --no-index --no-compile --upgrade --target /tmp/dfsite "$whl" || exit 3
export PYTHONPATH=/tmp/dfsite:$root
rc=0
run() { local name=$1 t=$2; shift 2; echo "=== $name ($(date +%T))"; timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log"
        local r=${PIPESTATUS[0]}; echo "=== $name exit $r"; [ "$r" = 0 ] || rc=1; }
run engine-tests 300 python3 -m pytest -q -p no:cacheprovider -s tests/test_engine_gpu.py tests/test_model_gpu.py tests/test_sampler.py
run gpu-suite 240 python3 -m pytest -q -p no:cacheprovider -m "gpu or sanitize" tests -k "not topk and not engine and not model_gpu and not sampler"
run main-auto 120 python3 -m deepfuse
run main-fp8 120 python3 -m deepfuse --kv-dtype fp8
run bench-engine 180 python3 -m microbench.bench_engine --out "$OUT" --batches 1 64 256 --context 512 ${BENCH_ARGS:-}
echo "gpu_engine: overall $([ $rc = 0 ] && echo OK || echo FAILURES)"
exit $rc
