"""The import graph of the library and the programs: no module of kernels/, tools/ or prototypes/ reaches itself
again through its imports, and kernels/ never imports tools/ or prototypes/ (the library stands alone).

Read from the source with ``ast``, nothing imported: every import statement counts wherever it stands -- at the top,
inside a function, under ``if TYPE_CHECKING:`` -- and so does ``importlib.import_module("a.literal.name")``. An
import inside a function is still an edge: deferring it only hides a circle until the function runs. Each module
depends on the modules it names and on the packages between (``import tools.peers.tile_configs`` runs
``tools/peers/__init__.py``), but not on the top-level packages ``kernels``, ``tools`` and ``prototypes``, which
every module of theirs imports first. Where a circle is found the test names each import inside it, file and line.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "tools", "prototypes")
FORBIDDEN = {"kernels": ("tools", "prototypes")}  # package -> the packages it must never import


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the packages (``pkg/__init__.py`` is ``pkg``)."""
    mods = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imported_names(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """(dotted name, line) of everything ``module``'s source imports: ``import a.b`` gives a.b, ``from a import b``
    gives a and a.b (b may be a submodule), relative imports resolved, ``import_module("x.y")`` gives x.y."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            yield base, node.lineno
            for alias in node.names:
                if alias.name != "*":
                    yield f"{base}.{alias.name}", node.lineno
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in ("import_module", "__import__"):
                yield node.args[0].value, node.lineno


def _graph() -> dict[str, dict[str, int]]:
    """module -> {module it depends on: the first line that imports it}, within the packages."""
    mods = _modules()
    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for module, path in mods.items():
        for name, line in _imported_names(module, path):
            parts = name.split(".")
            for depth in range(2, len(parts) + 1):  # the module and the packages between (never a top-level one)
                target = ".".join(parts[:depth])
                if target in mods and target != module and not module.startswith(target + "."):
                    graph[module].setdefault(target, line)
    return graph


def _circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _where(module: str) -> str:
    return str(_modules()[module].relative_to(ROOT))


def test_the_graph_is_read() -> None:
    """The parser sees the imports it must (a vacuous graph would pass the tests below). Any edge of each kind will
    do: when one of these imports goes, name another."""
    graph = _graph()
    assert "kernels.formats" in graph["kernels.contract"]  # a top-level import
    assert "kernels.checks" in graph["tools.harness"]  # one inside a function
    assert "kernels.expert_centric_path" in graph["kernels.dispatch"]  # importlib.import_module("...")
    assert "kernels.api" in graph["kernels"]  # one under `if TYPE_CHECKING:`


def test_circle_finder_finds_circles() -> None:
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}, "e": {"e": 1}, "f": {}}
    assert _circles(graph) == [["a", "b", "c"]]


def test_no_import_circles() -> None:
    graph = _graph()
    circles = _circles(graph)
    described = []
    for circle in circles:
        inside = [f"  {a} -> {b}  ({_where(a)}:{graph[a][b]})" for a in circle for b in sorted(graph[a]) if b in circle]
        described.append(f"import circle of {len(circle)} modules:\n" + "\n".join(inside))
    assert not circles, "\n".join(described)


def test_kernels_never_import_tools_or_prototypes() -> None:
    found: dict[str, list[str]] = {}
    for module, path in _modules().items():
        banned = FORBIDDEN.get(module.split(".")[0], ())
        for name, line in _imported_names(module, path):
            if name.split(".")[0] in banned:
                found.setdefault(f"{path.relative_to(ROOT)}:{line}", []).append(name)
    assert not found, "\n".join(f"{where} imports {', '.join(names)}" for where, names in found.items())
