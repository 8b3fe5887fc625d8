#!/usr/bin/env bash
# Builds a per-arch deepfuse wheel (version label +sm90a etc.) for a chosen Python.
#   usage: tools/build/build_wheels.sh [-p PYTHON] [-a ARCHS] [-o OUTDIR]
#     -p  Python the wheel is for (default python3; e.g. ~/.pyenv/versions/3.12.1/bin/python3
#         for the GPU machine's cp312)
#     -a  CUDA archs, e.g. "90a" (default) or "90a;100a"
#     -o  output folder (default wheelhouse/)
# TileLang kernels are lowered by DEEPFUSE_CODEGEN_PYTHON (a Python with torch + tilelang;
# default: .venv/bin/python when it exists, else PYTHON), so the target Python needs no torch.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
py=python3 archs=90a out="$root/wheelhouse"
while getopts "p:a:o:" o; do
  case $o in p) py=$OPTARG ;; a) archs=$OPTARG ;; o) out=$OPTARG ;; *) exit 2 ;; esac
done
codegen=${DEEPFUSE_CODEGEN_PYTHON:-}
[ -z "$codegen" ] && [ -x "$root/.venv/bin/python" ] && codegen="$root/.venv/bin/python"
[ -z "$codegen" ] && codegen=$py
ver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
benv="$root/build/venv-cp$ver"
if [ ! -x "$benv/bin/python" ]; then
  "$py" -m venv "$benv"
  "$benv/bin/pip" install -q "scikit-build-core>=0.11" "pybind11>=2.13" "cmake>=3.26" ninja
fi
mkdir -p "$out"
# one build tree per arch set (the default 90a one is the development build's)
bdir="$root/build/{wheel_tag}"
[ "$archs" != 90a ] && bdir="$bdir-sm$(echo "$archs" | tr -c '0-9a-z\n' '.')"
echo "building cp$ver wheel for archs '$archs' in $bdir (codegen: $codegen)"
DEEPFUSE_CUDA_ARCHS="$archs" DEEPFUSE_CODEGEN_PYTHON="$codegen" \
  "$benv/bin/pip" wheel --no-build-isolation --no-deps --config-settings=build-dir="$bdir" -w "$out" "$root"
# The commit the wheel was built from, for results recorded on the GPU machine.
c=$(git -C "$root" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
[ -n "$(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null)" ] && c="$c-dirty"
echo "$c" > "$out/COMMIT"
ls -la "$out"
