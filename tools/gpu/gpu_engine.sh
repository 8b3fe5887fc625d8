#!/usr/bin/env bash
# The engine's GPU checks in one device call (carrying wheelhouse/): engine / model / sampler /
# attention GPU tests, the main job, bench_engine (overlap on and off); FULL=1 adds the rest of
# the GPU suite but top-k and the main job with "fp8" caches. Logs to $OUT.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
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
run engine-tests 300 python3 -m pytest -q -p no:cacheprovider -s tests/engine/test_engine_gpu.py tests/model/test_model_gpu.py tests/engine/test_sampler.py
run attention-tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_attention_paged.py
[ -n "${FULL:-}" ] && run gpu-suite 240 python3 -m pytest -q -p no:cacheprovider -m "gpu or sanitize" tests -k "not topk and not engine and not model_gpu and not sampler and not attention"
run main-auto 120 python3 -m deepfuse
[ -n "${FULL:-}" ] && run main-fp8 120 python3 -m deepfuse --kv-dtype fp8
run bench-engine 240 python3 -m microbench.bench_engine --out "$OUT" --batches 1 64 256 --context 512 ${BENCH_ARGS:-}
echo "gpu_engine: overall $([ $rc = 0 ] && echo OK || echo FAILURES)"
exit $rc
