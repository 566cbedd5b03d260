"""The package's layout stays true: lp/'s imports, read from the code (ast), go one way.

Layers, lowest first (``lp/<folder>/__init__.py`` states each one's contract)::

    config < lookahead < grammar < drafts < kernels < model < parallel < engine < server < entry points

``lp.config`` is a leaf every layer may read; the entry points are ``lp/__init__`` (the public
API), ``lp.cli``, ``lp.command`` (the ``lp`` script), ``lp.generate`` and ``lp.serve``. A module
may import its own layer or a lower one, never a higher one; no two modules import each other, directly or around a circle
(imports inside functions count: they run too). Only lp/parallel/ touches torch.distributed;
lp/lookahead/ and lp/drafts/ never touch transformers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "lp"
LAYERS = ["config", "lookahead", "grammar", "drafts", "kernels", "model", "parallel", "engine", "server", "entry"]
RANK = {name: i for i, name in enumerate(LAYERS)}


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def layer(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) == 1 or parts[1] in ("cli", "command", "generate", "serve"):
        return "entry"
    if parts[1] == "config":
        return "config"
    assert parts[1] in RANK, f"{mod}: lp/{parts[1]} is not a known layer; add it to LAYERS"
    return parts[1]


def imports(path: Path, known: set[str], package: str = "lp") -> list[tuple[str, int]]:
    """Every ``package`` module this file imports (module level or inside functions), with its line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == package]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == package:
            for a in node.names:  # ``from lp.kernels import linears`` imports the submodule
                sub = f"{node.module}.{a.name}"
                out.append((sub if sub in known else node.module, node.lineno))
    return out


def third_party(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    return {m: {t for t, _ in imports(p, set(mods), root.name) if t != m} for m, p in mods.items()}


def upward_imports(root: Path = ROOT) -> list[str]:
    mods = modules(root)
    bad = []
    for m, p in mods.items():
        for target, line in imports(p, set(mods)):
            if target == "lp" and m != "lp":
                bad.append(f"{p.relative_to(root.parent)}:{line} imports the package root lp (the public API): "
                           "import the module it comes from")
            elif target in mods and RANK[layer(target)] > RANK[layer(m)]:
                bad.append(f"{p.relative_to(root.parent)}:{line} ({layer(m)}) imports {target} ({layer(target)}), "
                           "a higher layer")
    return bad


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in g:
                continue
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
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def folder_graph(g: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m, targets in g.items():
        out.setdefault(layer(m), set()).update(layer(t) for t in targets if layer(t) != layer(m))
    return out


# ---------------------------------------------------------------------------


def test_every_folder_is_a_known_layer_with_a_contract():
    for d in sorted(p for p in ROOT.iterdir() if p.is_dir() and p.name != "__pycache__"):
        assert d.name in RANK, f"lp/{d.name}/ is not a layer of the layout (tests/test_layout_imports.py LAYERS)"
        init = d / "__init__.py"
        assert init.is_file() and ast.get_docstring(ast.parse(init.read_text())), \
            f"lp/{d.name}/__init__.py must state the layer's contract in its docstring"


def test_no_import_goes_up_a_layer():
    bad = upward_imports()
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_circle_between_modules_or_folders():
    g = graph()
    assert not circles(g), f"import circles between modules: {circles(g)}"
    assert not circles(folder_graph(g)), f"import circles between folders: {circles(folder_graph(g))}"


@pytest.mark.parametrize("folder,forbidden", [
    ("lookahead", ("transformers", "torch.distributed")),
    ("grammar", ("transformers", "torch.distributed")),
    ("drafts", ("transformers", "torch.distributed", "torch")),
    ("kernels", ("torch.distributed",)),
    ("model", ("torch.distributed",)),
    ("engine", ("torch.distributed", "transformers")),
    ("server", ("torch.distributed",)),
])
def test_layer_keeps_its_libraries_out(folder, forbidden):
    for p in sorted((ROOT / folder).rglob("*.py")):
        used = third_party(p)
        hits = sorted(u for u in used for f in forbidden if u == f or u.startswith(f + "."))
        assert not hits, f"{p.relative_to(ROOT.parent)} imports {hits}: lp/{folder}/ must not"


def test_no_circle_between_bench_modules():
    """bench/ too: its modules import each other one way (a shared piece lives in a module both use)."""
    g = graph(ROOT.parent / "bench")
    assert not circles(g), f"import circles between bench modules: {circles(g)}"


def test_the_guard_sees_a_planted_circle_and_an_upward_import(tmp_path):
    """The checks above on a copy of lp/ with one planted upward, circular import."""
    import shutil

    copy = tmp_path / "lp"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    window = copy / "lookahead" / "window.py"
    window.write_text(window.read_text() + "\n\ndef _planted():\n    from lp.engine.decoder import LookaheadDecoder\n")
    assert any("lp/lookahead/window.py" in b and "lp.engine.decoder" in b for b in upward_imports(copy))
    comps = circles(graph(copy))
    assert any("lp.lookahead.window" in c and "lp.engine.decoder" in c for c in comps)
    assert circles(folder_graph(graph(copy)))
