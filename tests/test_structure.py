"""The code's shape, checked from the source alone (issue 20): every reach into vLLM goes
through `vllm_ext/compat/`, no afd_ctl, afd_data or vllm_ext module grows past 350 lines
(generated protobuf code aside; afd_ctl since issue 32), and the
packages' import graph has no cycle. Fast: `ast` only, nothing is imported, no vLLM needed."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("afd_ctl", "afd_data", "vllm_ext")
COMPAT = ROOT / "vllm_ext" / "compat"
MAX_LINES = 350
# Over the bound for now: none (issue 20 split the last ones).
OVER_MAX_FOR_NOW: set[str] = set()


def _is_generated(path: Path) -> bool:
    return "_pb2" in path.name


def _product_files(packages: tuple[str, ...] = PRODUCT) -> list[Path]:
    files: list[Path] = []
    for package in packages:
        files += [p for p in sorted((ROOT / package).rglob("*.py")) if not _is_generated(p)]
    return files


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_vllm(name: str) -> bool:
    return name == "vllm" or name.startswith("vllm.")


def _vllm_imports(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Every import of vLLM anywhere in a module, also inside functions, and every
    `importlib.import_module("vllm...")` with a literal (or f-string) name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_vllm(alias.name):
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and _is_vllm(node.module):
                yield node.lineno, f"from {node.module} import ..."
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name not in ("import_module", "__import__"):
                continue
            first = node.args[0]
            if isinstance(first, ast.JoinedStr) and first.values:
                first = first.values[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                if _is_vllm(first.value.rstrip(".")):
                    yield node.lineno, f"{name}({first.value!r}...)"


def test_vllm_is_imported_only_in_compat() -> None:
    """Nothing outside vllm_ext/compat/ imports vLLM (tests and benchmarks may)."""
    found = [
        f"{_rel(path)}:{line}: {what}"
        for path in _product_files()
        if COMPAT not in path.parents
        for line, what in _vllm_imports(ast.parse(path.read_text(), str(path)))
    ]
    assert not found, "vLLM imported outside vllm_ext/compat/ (reach it through compat):\n" + (
        "\n".join(found)
    )


def test_no_module_over_the_line_bound() -> None:
    too_long = []
    for path in _product_files(PRODUCT):
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES and _rel(path) not in OVER_MAX_FOR_NOW:
            too_long.append(f"{_rel(path)}: {lines} lines")
    assert not too_long, f"modules over {MAX_LINES} lines (split them along a seam):\n" + (
        "\n".join(too_long)
    )


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_time_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements run when the module is imported: the module body and the blocks under it
    (if/try/with/class), not function bodies, not `if TYPE_CHECKING:`."""
    for node in body:
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_time_statements(node.orelse)
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            for child in getattr(node, field, []) or []:
                if isinstance(child, ast.ExceptHandler):
                    yield from _import_time_statements(child.body)
                elif isinstance(child, ast.stmt):
                    yield from _import_time_statements([child])


def _runtime_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Every statement that may run, also inside functions (lazy imports), but not under
    `if TYPE_CHECKING:`."""
    for node in body:
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _runtime_statements(node.orelse)
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            for child in getattr(node, field, []) or []:
                if isinstance(child, ast.ExceptHandler):
                    yield from _runtime_statements(child.body)
                elif isinstance(child, ast.stmt):
                    yield from _runtime_statements([child])


def _import_graph(packages: tuple[str, ...] = PRODUCT, lazy: bool = False) -> dict[str, set[str]]:
    files = {_module_name(p): p for p in _product_files(packages)}
    statements = _runtime_statements if lazy else _import_time_statements
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        for node in statements(tree.body):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in files else base)
            graph[name].update(t for t in targets if t in files and t != name)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_import_graph_has_no_cycle() -> None:
    """Module-level imports of afd_ctl, afd_data and vllm_ext form no cycle (imports inside
    functions and under TYPE_CHECKING are not counted: they do not run at import time)."""
    graph = _import_graph()
    assert "afd_data.endpoints" in graph and graph["vllm_ext.hooks"], "the graph reads nothing"
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_data_and_control_planes_import_no_cycle_even_lazily() -> None:
    """afd_ctl and afd_data have no cycle even counting imports inside functions (a lazy
    import that closes a cycle is a cycle a reader still has to follow)."""
    graph = _import_graph(("afd_ctl", "afd_data"), lazy=True)
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_vllm_ext_imports_no_cycle_even_lazily() -> None:
    """vllm_ext has no cycle counting imports inside functions either (the plugin entry point,
    the hooks and the FFN role's entry once closed one)."""
    graph = _import_graph(("vllm_ext",), lazy=True)
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_product_code_imports_no_test_helper() -> None:
    """Only vllm_ext/testing/ itself (and tests, benchmarks) imports vllm_ext.testing."""
    graph = _import_graph(lazy=True)
    found = [
        f"{name} -> {target}"
        for name, targets in graph.items()
        if not name.startswith("vllm_ext.testing")
        for target in targets
        if target.startswith("vllm_ext.testing")
    ]
    assert not found, "product code imports test helpers:\n" + "\n".join(found)


def test_no_private_parts_reached_across_packages() -> None:
    """No `x._p` (a transport's private parts) outside afd_data: other packages use the
    transport's public accessors."""
    found = []
    for path in _product_files():
        if path.parts[-2] == "afd_data" or "afd_data" in path.relative_to(ROOT).parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "_p":
                found.append(f"{_rel(path)}:{node.lineno}")
    assert not found, "private transport parts reached from outside afd_data:\n" + "\n".join(found)


# The one module of vllm_ext that chooses an exchange implementation by path.
PATH_CHOOSER = "vllm_ext/exchange/factory.py"
PATH_NAMES = ("gpu", "nixl", "GPU", "NIXL")


def test_exchange_paths_are_compared_only_in_the_factory() -> None:
    """Callers never branch on the exchange path: no comparison with "gpu"/"nixl" (or the
    GPU/NIXL constants) in vllm_ext outside vllm_ext/exchange/factory.py."""

    def names_a_path(node: ast.expr) -> bool:
        if isinstance(node, ast.Constant) and node.value in ("gpu", "nixl"):
            return True
        return isinstance(node, ast.Name) and node.id in ("GPU", "NIXL")

    found = []
    for path in _product_files(("vllm_ext",)):
        if _rel(path) == PATH_CHOOSER:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare) and any(
                names_a_path(x) for x in (node.left, *node.comparators)
            ):
                found.append(f"{_rel(path)}:{node.lineno}")
    assert not found, "exchange path compared outside the factory:\n" + "\n".join(found)


def test_no_formatter_escapes_in_product_code() -> None:
    """`# fmt: skip` is not used to squeeze a module under the line bound."""
    found = [
        f"{_rel(path)}:{i}"
        for path in _product_files()
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if "fmt: skip" in line or "fmt: off" in line
    ]
    assert not found, "formatter escapes in product code:\n" + "\n".join(found)


def test_benchmarks_do_not_import_the_tests() -> None:
    """Benchmarks take their process helpers from vllm_ext.testing, not from tests/."""
    found = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            found += [
                f"{_rel(path)}:{node.lineno}: {n}" for n in names if n.split(".")[0] == "tests"
            ]
    assert not found, "benchmarks import tests/:\n" + "\n".join(found)
