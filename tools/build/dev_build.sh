#!/usr/bin/env bash
# Developer loop: incremental rebuild of deepfuse._C in the build tree that setup_env.sh
# configured, then the .so linked into python/deepfuse/ so the source tree imports it.
# One build at a time (a lock); run tests with PYTHONPATH=python.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
tag=$("$py" -c 'import sys; v="%d%d" % sys.version_info[:2]; print(f"cp{v}-cp{v}-linux_x86_64")')
bdir=$root/build/$tag
[ -f "$bdir/build.ninja" ] || { echo "no configured build in $bdir: run tools/build/setup_env.sh first" >&2; exit 1; }
exec 9>"${TMPDIR:-/tmp}/deepfuse-dev-build.lock"
flock 9
PATH=$(dirname "$py"):$PATH ninja -C "$bdir" _C
so=$(ls "$bdir"/_C*.so)
ln -sfn "$so" "$root/python/deepfuse/$(basename "$so")"
echo "built $so"
