"""Compare the SASS of two builds of the extension, kernel by kernel.

    python tools/probes/sass_diff.py BASE.so NEW.so [--only REGEX] [--show N] [--cuobjdump PATH]

BASE / NEW: a _C*.so, or a wheel (its deepfuse/_C*.so is read). Each kernel's listing
(`cuobjdump -sass`, per arch) is normalised: addresses inside a function are relative, so
only symbol names are replaced (mangled names inside instructions) and white space folded.
Kernels are matched by mangled name with anonymous-namespace tags removed (they hash the
source file's path), then by the demangled name without namespaces (a kernel moved between
namespaces or files), then by identical bodies (renamed). Reports kernels whose SASS differs
(with the first differing lines), kernels missing from NEW and new in NEW; exit status 1
when any differ or are missing.
"""
from __future__ import annotations

import argparse
import difflib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import defaultdict

_ANON = re.compile(r"(\d+)_GLOBAL__N__")
_SYM = re.compile(r"\b_Z\w+")


def find_cuobjdump(given: str | None) -> str:
    if given:
        return given
    found = shutil.which("cuobjdump")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        p = os.path.join(root, "bin", "cuobjdump")
        if root and os.path.exists(p):
            return p
    try:  # the copy that ships with triton
        import triton
        p = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        if os.path.exists(p):
            return p
    except ImportError:
        pass
    sys.exit("sass_diff: no cuobjdump found (pass --cuobjdump)")


def shared_object(path: str, tmp: str) -> str:
    if path.endswith(".whl"):
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if re.search(r"(^|/)_C[^/]*\.so$", n)]
            if not names:
                sys.exit(f"sass_diff: no _C*.so in {path}")
            return z.extract(names[0], os.path.join(tmp, hashlib.sha1(path.encode()).hexdigest()[:8]))
    return path


def strip_anon(name: str) -> str:
    """A mangled name without its anonymous-namespace tags (<len>_GLOBAL__N__<hash>_<file>_<hash>)."""
    out, i = [], 0
    for m in _ANON.finditer(name):
        if m.start() < i:
            continue
        n = int(m.group(1))
        start = m.start(1) + len(m.group(1))
        out.append(name[i:m.start()] + "ANON")
        i = start + n
    out.append(name[i:])
    return "".join(out)


def demangle(names: list[str]) -> dict[str, str]:
    tool = shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    r = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=True)
    return dict(zip(names, r.stdout.splitlines()))


def loose(demangled: str) -> str:
    """The demangled name without namespaces: 'void topk_kernel<0, 512, 3, true>(Params)'."""
    s = demangled.replace("(anonymous namespace)::", "")
    return re.sub(r"\b[A-Za-z_]\w*::", "", s)


def kernels(so: str, cuobjdump: str) -> dict[str, tuple[str, list[str]]]:
    """arch|name -> (mangled name, normalised SASS lines), from `cuobjdump -sass`."""
    r = subprocess.run([cuobjdump, "-sass", so], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"sass_diff: cuobjdump failed on {so}: {r.stderr.strip()}")
    out: dict[str, tuple[str, list[str]]] = {}
    arch, name, body = "?", None, []

    def flush():
        if name is not None:
            key = f"{arch}|{name}"
            k, n = key, 1
            while k in out:  # the same kernel in two translation units
                n += 1
                k = f"{key}#{n}"
            out[k] = (name, body)

    for line in r.stdout.splitlines():
        s = line.strip()
        if s.startswith("code for sm_"):
            flush()
            name, body = None, []
            arch = s.split()[-1]
        elif s.startswith("Function :"):
            flush()
            name, body = s.split(":", 1)[1].strip(), []
        elif s.startswith("Fatbin "):
            flush()
            name, body = None, []
        elif name is not None and s and not s.startswith(".headerflags"):
            body.append(" ".join(_SYM.sub("<sym>", s).split()))
    flush()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("--only", help="compare only kernels whose mangled or demangled name matches this regex")
    ap.add_argument("--show", type=int, default=12, help="differing lines shown per kernel")
    ap.add_argument("--cuobjdump")
    a = ap.parse_args()
    tool = find_cuobjdump(a.cuobjdump)
    with tempfile.TemporaryDirectory() as tmp:
        base = kernels(shared_object(a.base, tmp), tool)
        new = kernels(shared_object(a.new, tmp), tool)
    dm = demangle(sorted({v[0] for v in base.values()} | {v[0] for v in new.values()}))
    if a.only:
        rx = re.compile(a.only)
        keep = lambda d: {k: v for k, v in d.items() if rx.search(v[0]) or rx.search(dm.get(v[0], ""))}  # noqa: E731
        base, new = keep(base), keep(new)

    def keyed(d, keys, f):
        g = defaultdict(list)
        for k in keys:
            name, body = d[k]
            g[k.split("|", 1)[0] + "|" + f(k, name, body)].append(k)
        return g

    def dup(k):
        return k[k.find("#"):] if "#" in k else ""

    pairs, left_b, left_n = [], set(base), set(new)
    for f in (lambda k, name, body: strip_anon(name) + dup(k),  # the same kernel
              lambda k, name, body: loose(dm.get(name, name)) + dup(k),  # moved to another namespace
              lambda k, name, body: hashlib.sha1("\n".join(body).encode()).hexdigest()):  # renamed
        gb = keyed(base, left_b, f)
        gn = keyed(new, left_n, f)
        for key, kb in gb.items():
            kn = gn.get(key, [])
            if len(kb) == 1 and len(kn) == 1:
                pairs.append((kb[0], kn[0]))
                left_b.discard(kb[0])
                left_n.discard(kn[0])

    same = differ = 0
    for kb, kn in sorted(pairs):
        lb, ln = base[kb][1], new[kn][1]
        if lb == ln:
            same += 1
            continue
        differ += 1
        print(f"DIFFERS {dm.get(base[kb][0], base[kb][0])} [{kb.split('|')[0]}] ({len(lb)} -> {len(ln)} lines)")
        if base[kb][0] != new[kn][0]:
            print(f"  base {base[kb][0]}\n  new  {new[kn][0]}")
        shown = 0
        for d in difflib.unified_diff(lb, ln, lineterm="", n=0):
            if d.startswith(("---", "+++", "@@")):
                continue
            print("  " + d)
            shown += 1
            if shown >= a.show:
                break
    for k in sorted(left_b):
        print(f"MISSING {dm.get(base[k][0], base[k][0])} [{k.split('|')[0]}]")
    for k in sorted(left_n):
        print(f"NEW     {dm.get(new[k][0], new[k][0])} [{k.split('|')[0]}]")
    print(f"{len(pairs)} kernels compared: {same} identical, {differ} differ; "
          f"{len(left_b)} missing, {len(left_n)} new")
    return 1 if differ or left_b else 0


if __name__ == "__main__":
    sys.exit(main())
