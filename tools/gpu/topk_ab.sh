#!/usr/bin/env bash
# A/B timing of top-k kernel variants with tools/probes/topk_probe.cu, in one GPU call.
# Build here (local nvcc, ~40 s each); a variant is a name plus nvcc flags (-D switches
# you add to csrc/topk/*.cuh for the experiment), or a name and a source tree:
#   bash tools/gpu/topk_ab.sh build base
#   bash tools/gpu/topk_ab.sh build nobar -DDEEPFUSE_TOPK_AB_NOBAR
#   SRC=/path/to/other/checkout bash tools/gpu/topk_ab.sh build main
# -> ab/probe_<name> (git-ignored; carry ab/ with the device tool). On the GPU machine:
#   bash tools/gpu/topk_ab.sh run base nobar main    -> per variant and shape: graph/cold us and
#                                                   CTA 0's phase cycles (probe's header)
# History of the variants tried: docs/notes/topk-perf.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
  build)
    name=$2; shift 2
    src=${SRC:-.}
    mkdir -p ab
    if [ -f "$src/csrc/topk/topk_plan.cpp" ]; then  # the probe includes the kernels' .cuh
      srcs=("$src/csrc/topk/topk_plan.cpp")
    else
      srcs=("$src/csrc/topk/topk.cu" "$src/csrc/topk/topk_rows.cu")
    fi
    nvcc -O3 -std=c++17 -arch=sm_90a -DDEEPFUSE_TOPK_PROBE "$@" -I"$src/csrc" "$src/tools/probes/topk_probe.cu" \
      "${srcs[@]}" "$src/csrc/common/cuda_utils.cu" -o "ab/probe_$name"
    echo "built ab/probe_$name" ;;
  run)
    shift
    shapes=("1 8192 512" "1 8192 2048" "128 8192 512" "1 32768 512" "16 32768 512" "64 32768 2048"
            "128 32768 512" "1 131072 512" "16 131072 2048" "64 131072 512" "128 131072 512"
            "512 8192 512" "512 32768 1024" "512 131072 512" "16 129280 -512" "256 129280 -50"
            "256 129280 -512")
    for v in "$@"; do
      echo "== $v"
      for s in "${shapes[@]}"; do "./ab/probe_$v" $s | tail -n +2; done
    done ;;
  *) echo "usage: $0 build NAME [nvcc flags] | run NAME..."; exit 2 ;;
esac
