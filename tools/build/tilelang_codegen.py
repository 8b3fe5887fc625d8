#!/usr/bin/env python3
"""Build-time TileLang code generator (run by cmake/tilelang.cmake; no TileLang at run time).

    tilelang_codegen.py info     --out GEN --kernels kernels/a.py ...
    tilelang_codegen.py generate --out GEN --archs "90a;100a" --kernels kernels/a.py ...

Every public T.prim_func of a kernels/*.py module (its __all__, else every public
module-level PrimFunc) is one kernel; its Python name is the launcher name and must be
unique across modules. `info` writes GEN/tilelang_info.cmake (include dirs, kernel list).
`generate` lowers each kernel for each arch and writes:

- GEN/sm_<arch>/<name>.cu: TileLang's device code plus its host launcher, made linkable
  next to the other kernels and archs: the kernel is renamed dftl_<name>_sm_<arch>_kernel,
  the wrapper's extern "C" init / call / get_last_error become static, the two non-inline
  debug helpers of tl_templates/cuda/debug.h are renamed per file, and one exported
  function deepfuse::tl_gen::sm_<arch>::<name>(...) runs init once per device (only when a
  kernel needs more than 48 KB of dynamic shared memory), then call; it returns nullptr or
  the wrapper's error text.
- GEN/deepfuse_tl_kernels.h: `void deepfuse::tl::<name>(void* ..., int ..., cudaStream_t)`
  per kernel: picks the code for the current device's arch, throws std::runtime_error.
- GEN/deepfuse_tl_dispatch.cpp: those dispatchers.

PDL: TileLang's launcher always sets programmatic stream serialization. A kernel whose
device code never waits on the grid dependency (T.pdl_sync()) could then read inputs the
previous kernel on the stream has not finished writing, so for such kernels the attribute
is switched off here.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import time
from pathlib import Path

TILELANG_VERSION = "0.1.15"
# Wrapper internals this script relies on (tilelang.jit.adapter.wrapper in 0.1.15).
_ENTRY_POINTS = {
    'extern "C" TL_EXPORT const char* get_last_error()': "static const char* {sym}_get_last_error()",
    'extern "C" TL_EXPORT int init()': "static int {sym}_init()",
    'extern "C" TL_EXPORT int call(': "static int {sym}_call(",
}
_PDL_ON = "programmaticStreamSerializationAllowed = 1;"
_PDL_OFF = "programmaticStreamSerializationAllowed = 0;"
_DEBUG_HELPERS = ("debug_print_msg", "debug_print_buffer_value")


def fail(msg: str) -> "NoReturn":  # noqa: F821
    print(f"tilelang_codegen: error: {msg}", file=sys.stderr)
    sys.exit(1)


def import_tilelang():
    try:
        import importlib.metadata as md

        version = md.version("tilelang")
    except Exception:
        fail(f"TileLang is not installed for {sys.executable}. DEEPFUSE_TILELANG=ON needs a Python with "
             f"torch and tilelang=={TILELANG_VERSION}: set DEEPFUSE_CODEGEN_PYTHON, build with "
             "--no-build-isolation from such an environment, or set DEEPFUSE_TILELANG=OFF.")
    if version.split("+")[0] != TILELANG_VERSION:
        fail(f"tilelang {version} found at {sys.executable}, but deepfuse pins tilelang=={TILELANG_VERSION} "
             "(the generated host launcher comes from TileLang internals): pip install "
             f"tilelang=={TILELANG_VERSION}")
    import tilelang  # noqa: F401  (pulls torch)
    from tilelang import tvm

    return tilelang, tvm


def load_kernels(files: list[str], tvm) -> list[tuple[str, str, object]]:
    """-> [(module, name, prim_func)] sorted by (module, name); names unique."""
    out, seen = [], {}
    for f in sorted(files):
        path = Path(f).resolve()
        mod_name = path.stem
        spec = importlib.util.spec_from_file_location(f"deepfuse_kernels.{mod_name}", path)
        mod = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(mod)
        except Exception as e:
            fail(f"importing {path} failed: {type(e).__name__}: {e}")
        names = getattr(mod, "__all__", None)
        if names is None:
            names = [n for n, v in vars(mod).items() if not n.startswith("_") and isinstance(v, tvm.tirx.PrimFunc)]
        for n in sorted(names):
            fn = getattr(mod, n, None)
            if not isinstance(fn, tvm.tirx.PrimFunc):
                fail(f"{path}: {n} is listed in __all__ but is not a T.prim_func")
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n):
                fail(f"{path}: kernel name {n!r} is not a C identifier")
            if n in seen:
                fail(f"kernel name {n} is defined in both {seen[n]} and {path}; launcher names must be unique")
            seen[n] = path
            out.append((mod_name, n, fn))
    if not out:
        fail("no T.prim_func found in " + ", ".join(files))
    return out


def parse_archs(archs: str) -> list[str]:
    out = []
    for a in re.split(r"[;,\s]+", archs.strip()):
        if not a:
            continue
        if not re.fullmatch(r"\d+[af]?", a):
            fail(f"cannot lower TileLang kernels for CUDA arch {a!r} (expected e.g. 90a or 100a)")
        out.append(a)
    if not out:
        fail("no CUDA arch given")
    return out


def include_dirs() -> tuple[str, str]:
    import tilelang.env as env

    src = os.path.realpath(env.TILELANG_TEMPLATE_PATH)
    cutlass = os.path.realpath(env.CUTLASS_INCLUDE_DIR)
    for d in (src, cutlass):
        if not os.path.isdir(d):
            fail(f"TileLang include directory {d} is missing")
    return src, cutlass


def cmd_info(args) -> None:
    _, tvm = import_tilelang()
    kernels = load_kernels(args.kernels, tvm)
    src, cutlass = include_dirs()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Written by tools/build/tilelang_codegen.py info; do not edit.",
        f'set(DEEPFUSE_TL_SRC_DIR "{src}")',
        f'set(DEEPFUSE_TL_CUTLASS_DIR "{cutlass}")',
        "set(DEEPFUSE_TL_KERNELS " + " ".join(n for _, n, _ in kernels) + ")",
    ]
    _write(out / "tilelang_info.cmake", "\n".join(lines) + "\n")


# ----------------------------------------------------------------------------- generate
def lower_one(tilelang, tvm, func, sym: str, arch: str) -> tuple[str, str]:
    """-> (wrapped source, device source) for one prim_func and one arch."""
    from tilelang.jit.adapter.wrapper import TLWrapper

    target = tvm.target.Target({"kind": "cuda", "arch": f"sm_{arch}"})
    func = func.with_attr("global_symbol", sym)
    with tvm.transform.PassContext(opt_level=3), target:
        art = tilelang.lower(func, target=target)
    wrapper = TLWrapper(target)
    wrapper.assign_optimized_module(tvm.IRModule({sym: func}))
    wrapper.assign_pass_configs({})
    wrapper.assign_host_module(art.host_mod)
    wrapper.assign_device_module(art.device_mod)
    return wrapper.wrap(art.kernel_source), art.kernel_source


def _split_params(sig: str) -> list[tuple[str, str, bool]]:
    """'bfloat16_t* __restrict__ W, int N, cudaStream_t stream=...' -> [(type, name, is_ptr)]."""
    out = []
    for p in sig.split(","):
        p = p.split("=")[0].replace("__restrict__", " ").strip()
        m = re.fullmatch(r"(.+?)\s*(\*?)\s*([A-Za-z_]\w*)", p)
        if not m:
            fail(f"cannot parse launcher parameter {p!r}")
        ty, star, name = m.group(1).strip(), m.group(2), m.group(3)
        out.append((ty + star, name, bool(star)))
    return out


def postprocess(code: str, device_src: str, name: str, arch: str, sym: str) -> tuple[str, list]:
    """Make one generated file linkable with the others; -> (code, public params)."""
    for old, new in _ENTRY_POINTS.items():
        n = code.count(old)
        if n != 1:
            fail(f"{name} (sm_{arch}): expected one `{old}` in TileLang's wrapper, found {n}; "
                 f"the wrapper changed (pinned tilelang=={TILELANG_VERSION})")
        code = code.replace(old, new.format(sym=sym))
    waits = "cudaGridDependencySynchronize" in device_src or "griddepcontrol.wait" in device_src
    pdl_note = "kernel waits on the grid dependency: PDL launch kept"
    if not waits:
        if code.count(_PDL_ON) < 1:
            fail(f"{name} (sm_{arch}): launch attribute `{_PDL_ON}` not found in TileLang's wrapper")
        code = code.replace(_PDL_ON, _PDL_OFF)
        pdl_note = "kernel has no T.pdl_sync(): programmatic stream serialization switched off"
    # init() only raises the dynamic shared memory limit; below the default 48 KB it is not
    # needed, and skipping it keeps the first call free of non-stream CUDA calls (graph capture).
    smem = [int(v) for v in re.findall(r"cudaFuncAttributeMaxDynamicSharedMemorySize, (\d+)\)", code)]
    needs_init = any(v > 48 * 1024 for v in smem)
    m = re.search(r"static int " + re.escape(sym) + r"_call\((.*?)\) \{", code, re.S)
    if not m:
        fail(f"{name} (sm_{arch}): cannot find the launcher signature")
    params = _split_params(m.group(1))
    if params[-1][0] != "cudaStream_t":
        fail(f"{name} (sm_{arch}): launcher does not end with a cudaStream_t parameter")
    head = [
        f"// Generated by tools/build/tilelang_codegen.py from kernel {name} for sm_{arch} (TileLang {TILELANG_VERSION}).",
        f"// Do not edit; {pdl_note}.",
    ]
    head += [f"#define {h} {h}_{sym}" for h in _DEBUG_HELPERS]
    head += ["#include <atomic>", "#include <mutex>", ""]
    init = f"""  static std::atomic<unsigned long long> ready{{0}};  // bit d: init() done on device d
  static std::mutex mu;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  const unsigned long long bit = dev < 64 ? (1ull << dev) : 0ull;
  if (!(ready.load(std::memory_order_acquire) & bit)) {{
    std::lock_guard<std::mutex> lock(mu);
    if ({sym}_init() != 0) return {sym}_get_last_error();
    ready.fetch_or(bit, std::memory_order_release);
  }}
""" if needs_init else f"  (void){sym}_init;  // dynamic shared memory {max(smem, default=0)} B <= 48 KB: no attribute to set\n"
    pub = ", ".join(f"{'void*' if ptr else ty} {n}" for ty, n, ptr in params)
    fwd = ", ".join(f"({ty}){n}" if ptr else n for ty, n, ptr in params)
    tail = f"""

// ---- deepfuse entry point (generated)
namespace deepfuse {{ namespace tl_gen {{ namespace sm_{arch} {{
const char* {name}({pub}) {{
{init}  if ({sym}_call({fwd}) != 0) return {sym}_get_last_error();
  return nullptr;
}}
}} }} }}  // namespace deepfuse::tl_gen::sm_{arch}
"""
    return "\n".join(head) + "\n" + code + tail, params


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _arch_test(arch: str) -> str:
    """C++ condition on `cc` (major * 10 + minor) for the devices that run SASS for `arch`."""
    num = int(re.match(r"\d+", arch).group(0))
    if arch.endswith("a"):
        return f"cc == {num}"
    return f"cc >= {num} && cc / 10 == {num // 10}"


def cmd_generate(args) -> None:
    tilelang, tvm = import_tilelang()
    archs = parse_archs(args.archs)
    kernels = load_kernels(args.kernels, tvm)
    out = Path(args.out)
    signatures: dict[str, list] = {}
    for _, name, func in kernels:
        for arch in archs:
            t0 = time.time()
            sym = f"dftl_{name}_sm_{arch}"
            try:
                code, device_src = lower_one(tilelang, tvm, func, sym, arch)
            except Exception as e:
                fail(f"lowering {name} for sm_{arch} failed: {type(e).__name__}: {e}")
            code, params = postprocess(code, device_src, name, arch, sym)
            pub = [(("void*" if p else t), n) for t, n, p in params]
            if signatures.setdefault(name, pub) != pub:
                fail(f"{name}: launcher signature differs between archs: {signatures[name]} vs {pub}")
            _write(out / f"sm_{arch}" / f"{name}.cu", code)
            print(f"tilelang_codegen: {name} sm_{arch} lowered in {time.time() - t0:.1f} s", flush=True)

    built = ", ".join(f"sm_{a}" for a in archs)
    hdr = [
        "// Generated by tools/build/tilelang_codegen.py: launchers of the TileLang kernels in kernels/*.py.",
        "// Each picks the code built for the current device's arch and throws std::runtime_error",
        "// on failure (no kernel for this GPU, launch error). No allocation, no synchronisation.",
        "#pragma once",
        "#include <cuda_runtime.h>",
        "",
        "namespace deepfuse { namespace tl {",
        f'inline constexpr const char* kBuiltArchs = "{built}";',
    ]
    disp = [
        "// Generated by tools/build/tilelang_codegen.py; do not edit.",
        '#include "deepfuse_tl_kernels.h"',
        "",
        "#include <atomic>",
        "#include <stdexcept>",
        "#include <string>",
        "",
    ]
    for arch in archs:
        disp.append(f"namespace deepfuse {{ namespace tl_gen {{ namespace sm_{arch} {{")
        for name, pub in signatures.items():
            disp.append(f"const char* {name}({', '.join(f'{t} {n}' for t, n in pub)});")
        disp.append("} } }")
    disp += [
        "",
        "namespace deepfuse { namespace tl {",
        "namespace {",
        "int device_cc() {  // major * 10 + minor of the current device, cached per device",
        "  static std::atomic<int> cache[64];  // 0 = unknown",
        "  int dev = 0;",
        "  cudaError_t e = cudaGetDevice(&dev);",
        '  if (e != cudaSuccess) throw std::runtime_error(std::string("deepfuse: cudaGetDevice: ") + cudaGetErrorString(e));',
        "  if (dev < 64) {",
        "    if (const int c = cache[dev].load(std::memory_order_relaxed)) return c;",
        "  }",
        "  int major = 0, minor = 0;",
        "  e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);",
        "  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);",
        '  if (e != cudaSuccess) throw std::runtime_error(std::string("deepfuse: cudaDeviceGetAttribute: ") + cudaGetErrorString(e));',
        "  const int cc = major * 10 + minor;",
        "  if (dev < 64) cache[dev].store(cc, std::memory_order_relaxed);",
        "  return cc;",
        "}",
        "[[noreturn]] void fail(const char* kernel, const char* arch, const char* err) {",
        '  throw std::runtime_error(std::string("deepfuse: TileLang kernel ") + kernel + " (" + arch + "): " + err);',
        "}",
        "}  // namespace",
        "",
    ]
    for name, pub in signatures.items():
        decl = f"void {name}({', '.join(f'{t} {n}' for t, n in pub)})"
        hdr.append(decl + ";")
        call = ", ".join(n for _, n in pub)
        disp.append(decl + " {")
        disp.append("  const int cc = device_cc();")
        for arch in archs:
            disp.append(f"  if ({_arch_test(arch)}) {{")
            disp.append(f"    if (const char* err = tl_gen::sm_{arch}::{name}({call})) fail(\"{name}\", \"sm_{arch}\", err);")
            disp.append("    return;")
            disp.append("  }")
        disp.append(f'  fail("{name}", ("sm_" + std::to_string(cc)).c_str(), '
                    f'"no code for this GPU in this build (built for {built})");')
        disp.append("}")
        disp.append("")
    hdr += ["} }  // namespace deepfuse::tl", ""]
    disp += ["} }  // namespace deepfuse::tl", ""]
    _write(out / "deepfuse_tl_kernels.h", "\n".join(hdr))
    _write(out / "deepfuse_tl_dispatch.cpp", "\n".join(disp))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("info", "generate"))
    ap.add_argument("--out", required=True, help="output directory (in the build tree)")
    ap.add_argument("--archs", default="90a", help='CUDA archs, e.g. "90a;100a"')
    ap.add_argument("--kernels", nargs="+", required=True, help="kernels/*.py files")
    a = ap.parse_args(argv)
    (cmd_info if a.mode == "info" else cmd_generate)(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
