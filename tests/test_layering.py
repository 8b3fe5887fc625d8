"""The package's layers, read from the source (ast, nothing is imported).

Bottom to top: kv_format; ops (may import kv_format, _ext, ops.*); step (the step types the
model consumes: may import ops, kv_format); models (ops, kv_format, step); engine (models and
below); serve (engine and below, and the CLI's argument checks in deepfuse.__main__, the top).
Importing an ancestor package is allowed (it is imported first anyway). No module imports a
layer above its own, and no two deepfuse modules import each other, directly or through
others, at module level or inside functions.
"""
import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "python" / "deepfuse"

# layer -> the layers of ours it may import (besides itself)
ALLOWED = {
    "_version": set(),
    "_ext": set(),
    "kv_format": set(),
    "ops": {"_ext", "kv_format"},
    "step": {"ops", "kv_format", "_ext"},
    "models": {"ops", "kv_format", "step", "_ext"},
    "engine": {"models", "ops", "kv_format", "step", "_ext"},
    "serve": {"engine", "models", "ops", "kv_format", "step", "_ext", "__main__"},
    "__init__": {"_version", "_ext", "ops"},
    "__main__": {"engine", "models", "ops", "kv_format", "step", "_ext", "serve"},
}

# (importer, imported) edges kept out of the cycle check; keep it empty
CYCLE_EXCEPTIONS: set[tuple[str, str]] = set()


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py")) if "__pycache__" not in p.parts}


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The deepfuse modules `name` imports anywhere in its file (resolved to known modules)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            if not t.startswith("deepfuse"):
                continue
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {n: imports(n, p, known) for n, p in mods.items()}


def layer(mod: str) -> str:
    parts = mod.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def test_package_found():
    g = graph()
    for m in ("deepfuse.kv_format", "deepfuse.ops.norm", "deepfuse.step", "deepfuse.models.model",
              "deepfuse.engine.engine", "deepfuse.serve.app"):
        assert m in g, f"{m} not found under {PKG}"


def test_no_import_upwards():
    bad = []
    for mod, deps in graph().items():
        lay = layer(mod)  # importing an ancestor package is implicit in importing any module below it
        assert lay in ALLOWED, f"{mod}: layer {lay!r} has no rule in ALLOWED"
        for d in deps:
            dl = layer(d)
            if dl != lay and dl not in ALLOWED[lay] and not mod.startswith(d + "."):
                bad.append(f"{mod} -> {d}")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_no_cycles():
    g = graph()
    # a package's __init__ re-exporting its submodules is not a cycle back into it
    edges = {m: {d for d in deps if (m, d) not in CYCLE_EXCEPTIONS and not m.startswith(d + ".")}
             for m, deps in g.items()}
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not sccs, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in sccs)


@pytest.mark.parametrize("mod", ["deepfuse.models", "deepfuse.models.model"])
def test_models_never_import_engine(mod):
    g = graph()
    assert mod in g
    assert not {d for d in g[mod] if layer(d) in ("engine", "serve")}
