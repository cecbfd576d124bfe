"""The package's structure, read from its source: no module imports, directly or through others, a module that imports
it back (an import cycle ties modules that should be read, tested and changed apart; Python hides one until the
wrong module is imported first). Every import counts, those inside functions too: a deferred import is still a
dependency, only a later one."""

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGES = ("tr_engine", "weights_tools", "bench")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project's modules that `path` imports: `import a.b`, `from a import b` (b a module or a name in a),
    relative imports resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import a.b.c` depends on the deepest module it names
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def import_graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {module_name(p) for p in files}
    return {module_name(p): imports_of(p, modules) for p in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 40 and "tr_engine.model.llama" in graph["tr_engine.engine"] | set().union(*graph.values())
    assert cycles(graph) == [], "modules that import each other, directly or through others: " + "; ".join(
        " <-> ".join(c) for c in cycles(graph))


def test_the_cycle_finder_finds_direct_deferred_and_relative_imports(tmp_path):
    """The checker itself: a cycle through a function-level import and one through a relative import are found, and
    a chain without one is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "x.py").write_text("def f():\n    from p import y\n")
    (pkg / "y.py").write_text("from . import x\nfrom .x import f\n")
    modules = {"p", "p.x", "p.y"}
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert imports_of(pkg / "x.py", modules) == {"p", "p.y"}
        assert imports_of(pkg / "y.py", modules) == {"p", "p.x"}
    finally:
        ROOT = saved


def calls_of(module: str, name: str) -> list[str]:
    """The package's functions that call `module`'s function `name`: in `module` itself by its name, elsewhere
    through `from module import name` (under its alias) or `module_tail.name(...)` after importing the module."""
    tail = module.rpartition(".")[2]
    callers = []
    for path in sorted((ROOT / "tr_engine").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        here = module_name(path) == module
        aliases = {name} if here else set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == module:
                aliases |= {a.asname or a.name for a in node.names if a.name == name}
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            local = {n.name for n in ast.walk(fn) if isinstance(n, ast.FunctionDef) and n is not fn}  # (shadows)
            for node in ast.walk(fn):
                if isinstance(node, ast.Call):
                    f = node.func
                    if (isinstance(f, ast.Name) and f.id in aliases - local) or (
                            isinstance(f, ast.Attribute) and f.attr == name and isinstance(f.value, ast.Name)
                            and f.value.id == tail):
                        callers.append(f"{module_name(path)}.{fn.name}")
    return callers


def test_one_decode_loop_drives_the_one_step_and_the_step_is_short():
    """The paper's loop is one `step` (retrieve, verify, accept, compact, learn, recycle; at most 40 lines with its
    docstring), and one driver runs it for one sequence or many (tr_engine/core/batch.py); the plain decoding of
    tr_engine/core/decode.py is the tests' oracle, and token_recycling_reference the teaching twin, not production
    loops."""
    source = (ROOT / "tr_engine" / "core" / "speculative.py").read_text()
    step = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "step")
    assert step.end_lineno - step.lineno + 1 <= 40
    assert calls_of("tr_engine.core.speculative", "step") == ["tr_engine.core.batch.batch_steps"]
    assert set(calls_of("tr_engine.core.batch", "batch_steps")) == {  # (methods by their function's name)
        "tr_engine.core.batch.speculative_steps", "tr_engine.engine.batch_loop"}
    assert calls_of("tr_engine.core.decode", "plain_steps") == ["tr_engine.core.decode.plain_generate"]
    assert calls_of("tr_engine.core.decode", "plain_generate") == []  # (the tests' and a benchmark's, not the engine's)


LAYERS = {"tr_engine": 0, "tr_engine.errors": 0, "tr_engine.checks": 0, "tr_engine.files": 0, "tr_engine.model": 1,
          "tr_engine.core": 2, "tr_engine.engine": 3, "tr_engine.serving": 4, "tr_engine.cli": 5,
          "tr_engine.chat": 6, "tr_engine.generate": 6, "tr_engine.serve": 6}


def layer(module: str) -> int:
    """A module's layer: its sub-package's place in README's map (the commands' entry points tr_engine/<name>.py
    last; the package itself, which holds only its version, first)."""
    while module not in LAYERS:
        module = module.rpartition(".")[0]
    return LAYERS[module]


def test_the_folders_are_layers_each_importing_only_those_below_it():
    """errors/checks/files < model (the network) < core (the algorithm) < engine (the API) < serving < cli: the map
    in README.md is the package's structure."""
    modules = {module_name(p): p for p in (ROOT / "tr_engine").rglob("*.py")}
    upward = [f"{m} imports {t}" for m, p in sorted(modules.items()) for t in imports_of(p, set(modules))
              if layer(t) > layer(m)]
    assert upward == []
