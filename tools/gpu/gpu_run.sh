#!/usr/bin/env bash
# Everything GPU-side in one run on the GPU machine: install the carried wheel, GPU tests,
# compute-sanitizer (memcheck, racecheck, synccheck) over the `sanitize` tests, microbenchmarks,
# the top-k stress and tail runs and the decode loop.
#   usage (device tool, from the repo root, carrying wheelhouse/):
#     bash tools/gpu/gpu_run.sh [stages...]      stages: info tests sanitize bench (default: these
#                                            four), stress, tail, decode
#   env: OUT (results folder; default ./gpu-out), BENCH_ARGS (e.g. "--quick --only cast"),
#        KSEL (pytest -k expression, e.g. "cast or topk"), STRESS_S (default 30),
#        TAIL_ARGS (e.g. "--draws 1500")
# Logs go to $OUT/*.log; JSON + PNG results are packed into $OUT/results.tgz.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
OUT=${OUT:-$root/gpu-out}
mkdir -p "$OUT" /tmp/deepfuse-res
stages=${*:-info tests sanitize bench}
export PYTHONUNBUFFERED=1
export DEEPFUSE_COMMIT=${DEEPFUSE_COMMIT:-$(cat wheelhouse/COMMIT 2>/dev/null || git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}

whl=$(ls wheelhouse/deepfuse-*cp312*.whl 2>/dev/null | head -n1)
if [ -z "$whl" ]; then echo "no cp312 wheel in wheelhouse/"; exit 2; fi
python3 -m pip install -q --no-deps --no-index --no-compile --upgrade --target /tmp/dfsite "$whl" || exit 3
export PYTHONPATH=/tmp/dfsite:$root   # installed package + microbench/ from the tree
rc=0
run() {  # name, timeout, command...
  local name=$1 t=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log"
  local r=${PIPESTATUS[0]}
  echo "=== $name exit $r"
  [ "$r" = 0 ] || rc=1
}
for s in $stages; do
  case $s in
    info)
      run info 60 bash -c 'nvidia-smi; python3 -c "import torch, deepfuse; print(torch.__version__, deepfuse.__version__, deepfuse.built_archs(), torch.cuda.get_device_name())"' ;;
    tests)
      run gpu-tests 420 python3 -m pytest -q -m "gpu or sanitize" -p no:cacheprovider tests -k "${KSEL:-}" ;;
    sanitize)
      for tool in memcheck racecheck synccheck; do
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 run "sanitize-$tool" 300 compute-sanitizer --tool "$tool" \
          --error-exitcode 9 --target-processes all python3 -m pytest -q -x -m sanitize -p no:cacheprovider tests -k "${KSEL:-}"
      done ;;
    bench)
      run bench 540 python3 -m microbench.run --out /tmp/deepfuse-res ${BENCH_ARGS:-} ;;
    stress)
      run stress $((${STRESS_S:-30} + 60)) python3 tests/ops/stress_topk.py --seconds "${STRESS_S:-30}" ;;
    tail)
      run tail 300 python3 tools/probes/topk_tail.py ${TAIL_ARGS:-} ;;
    decode)
      run decode 300 python3 -m deepfuse ;;
  esac
done
tar -C /tmp/deepfuse-res -czf "$OUT/results.tgz" . 2>/dev/null
echo "gpu_run: overall $([ $rc = 0 ] && echo OK || echo FAILURES)"
exit $rc
