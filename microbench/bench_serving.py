"""Serving benchmark (in the manner of sglang.bench_serving): N requests with given input /
output lengths at a request rate or a concurrency limit, against deepfuse.serve (or any
OpenAI-compatible server); reports request throughput, input / output tokens per second,
time to first token, inter-token latency, time per output token and end-to-end latency
(mean, p50, p99) as JSON (GPU, date, commit).

    # start the server itself (extra server options after --server-args), three concurrencies:
    python -m microbench.bench_serving --model /path/to/ckpt --device cuda --max-concurrency 1,16,64 \\
        --num-prompts 128 --input-len 1024 --output-len 256 --out results/
    # or against a running server:
    python -m microbench.bench_serving --base-url http://127.0.0.1:8000 --num-prompts 64 --request-rate 8

Prompts are random token ids (the text-token range of the V4 vocabulary) sent to
/v1/completions as ids with ignore_eos, so every request produces exactly its output length;
--endpoint chat sends random words through /v1/chat/completions instead."""
from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


@dataclass
class Result:
    ok: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list = field(default_factory=list)
    error: str = ""


def _commit() -> str:
    if os.environ.get("DEEPFUSE_COMMIT"):
        return os.environ["DEEPFUSE_COMMIT"]
    try:
        root = Path(__file__).resolve().parent.parent
        return subprocess.check_output(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                                       stderr=subprocess.DEVNULL, text=True).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def _gpu() -> str:
    try:
        out = subprocess.check_output(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                      stderr=subprocess.DEVNULL, text=True, timeout=10).strip().splitlines()
        return f"{len(out)}x {out[0]}" if out else "none"
    except Exception:  # noqa: BLE001
        return "none"


def _pct(xs, p):
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _summary(xs, scale=1000.0):
    """mean / p50 / p99 (ms by default)."""
    if not xs:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    return {"mean": statistics.fmean(xs) * scale, "p50": _pct(xs, 50) * scale, "p99": _pct(xs, 99) * scale}


def make_requests(args) -> list[tuple[object, int, int]]:
    """-> [(prompt (ids or text), prompt length, output length)]"""
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.num_prompts):
        lo = max(1, int(args.input_len * args.range_ratio))
        n_in = rng.randint(lo, args.input_len)
        n_out = rng.randint(max(1, int(args.output_len * args.range_ratio)), args.output_len)
        if args.endpoint == "completions":
            prompt = [rng.randrange(1000, 100000) for _ in range(n_in)]  # plain text tokens of the V4 vocabulary
        else:
            prompt = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "omega", "sigma")) for _ in range(n_in))
        out.append((prompt, n_in, n_out))
    return out


async def one(client, args, model, prompt, n_in, n_out) -> Result:
    import httpx

    r = Result(prompt_len=n_in)
    if args.endpoint == "completions":
        url = "/v1/completions"
        body = {"model": model, "prompt": prompt, "max_tokens": n_out, "temperature": args.temperature,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    else:
        url = "/v1/chat/completions"
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": n_out,
                "temperature": args.temperature, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "thinking": {"type": "disabled"}}
    t0 = time.perf_counter()
    last = None
    n_chunks = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                d = json.loads(data)
                if "error" in d:
                    r.error = str(d["error"])[:200]
                    return r
                if d.get("usage"):
                    r.output_len = d["usage"].get("completion_tokens", 0)
                    if d["usage"].get("prompt_tokens"):
                        r.prompt_len = d["usage"]["prompt_tokens"]
                ch = d.get("choices") or []
                has = any((c.get("text") or (c.get("delta") or {}).get("content")
                           or (c.get("delta") or {}).get("reasoning_content")) for c in ch)
                if not has:
                    continue
                now = time.perf_counter()
                if last is None:
                    r.ttft = now - t0
                else:
                    r.itl.append(now - last)
                last = now
                n_chunks += 1
        r.latency = time.perf_counter() - t0
        r.output_len = r.output_len or n_chunks
        r.ok = last is not None
        if not r.ok:
            r.error = "no tokens"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        r.error = f"{type(e).__name__}: {e}"
    return r


async def run_level(args, base_url, model, reqs, concurrency: Optional[int]) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(args.seed + 1)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        for p, n_in, n_out in reqs[:args.warmup]:  # warm-up (not measured)
            await one(client, args, model, p, n_in, min(n_out, 8))

        async def guarded(p, n_in, n_out):
            if sem is None:
                return await one(client, args, model, p, n_in, n_out)
            async with sem:
                return await one(client, args, model, p, n_in, n_out)

        tasks = []
        t0 = time.perf_counter()
        for p, n_in, n_out in reqs:
            tasks.append(asyncio.create_task(guarded(p, n_in, n_out)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        dur = time.perf_counter() - t0
        try:
            server_stats = (await client.get("/stats")).json()
        except Exception:  # noqa: BLE001
            server_stats = None
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_len for r in ok)
    in_tok = sum(r.prompt_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    return {
        "max_concurrency": concurrency,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf", "num_prompts": len(reqs),
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": dur, "request_throughput": len(ok) / dur, "input_throughput": in_tok / dur,
        "output_throughput": out_tok / dur, "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "ttft_ms": _summary([r.ttft for r in ok]), "itl_ms": _summary([x for r in ok for x in r.itl]),
        "tpot_ms": _summary(tpot), "e2e_latency_ms": _summary([r.latency for r in ok]),
        "server_stats": server_stats,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args):
    import httpx

    port = args.port or _free_port()
    cmd = [sys.executable, "-m", "deepfuse.serve", "--model", args.model, "--port", str(port), "--log-level",
           "warning"]
    if args.device:
        cmd += ["--device", args.device]
    cmd += args.server_args.split() if args.server_args else []
    print("starting:", " ".join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + args.startup_timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.terminate()
            raise SystemExit("the server did not come up")
        time.sleep(1)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m microbench.bench_serving", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000")
    g.add_argument("--model", help="start `python -m deepfuse.serve --model MODEL` for the run (DIR or tiny)")
    p.add_argument("--device", default=None, help="--device for the started server (cuda / cpu)")
    p.add_argument("--server-args", default="", help="more options for the started server, one string")
    p.add_argument("--port", type=int, default=None, help="port of the started server (default: a free one)")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--served-model-name", default=None, help="model name in requests (default: the server's first)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--range-ratio", type=float, default=1.0, help="lengths uniform in [ratio * len, len]")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--max-concurrency", default="", help="concurrency limit(s), comma-separated: one run each")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="a .json file, or a folder for bench_serving-<date>.json")
    args = p.parse_args(argv)

    import httpx

    proc = None
    if args.base_url:
        base = args.base_url.rstrip("/")
    else:
        proc, base = start_server(argparse.Namespace(**{**vars(args), "model": args.model or "tiny"}))
    try:
        model = args.served_model_name or httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        reqs = make_requests(args)
        levels = [int(x) for x in args.max_concurrency.split(",") if x.strip()] or [None]
        runs = []
        for c in levels:
            res = asyncio.run(run_level(args, base, model, reqs, c))
            runs.append(res)
            print(f"concurrency {c or 'inf'}: {res['completed']}/{res['num_prompts']} ok, "
                  f"{res['request_throughput']:.2f} req/s, {res['output_throughput']:.1f} out tok/s, "
                  f"TTFT p50 {res['ttft_ms']['p50']:.1f} ms, ITL p50 {res['itl_ms']['p50']:.2f} ms, "
                  f"ITL p99 {res['itl_ms']['p99']:.2f} ms", file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    report = {"bench": "serving", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "commit": _commit(), "gpu": _gpu(), "model": model, "source": args.model or args.base_url,
              "endpoint": args.endpoint, "input_len": args.input_len, "output_len": args.output_len,
              "range_ratio": args.range_ratio, "seed": args.seed, "server_args": args.server_args,
              "runs": runs}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        out = Path(args.out)
        if out.suffix != ".json":
            out.mkdir(parents=True, exist_ok=True)
            out = out / f"bench_serving-{_dt.datetime.now():%Y%m%d-%H%M%S}.json"
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"saved {out}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
