"""Import rules of the source tree (docs/architecture.md, "Packages"):

- the process packages (target_server, drafter_worker, metrics_sidecar) never import one another;
- common imports none of them (it is what more than one process needs);
- the target server imports no drafter model code (no drafter_worker, no triton);
- no import cycle between the project's modules, counting imports inside functions too
  (a local import that only hides a cycle is still a cycle).

Read from the source with ``ast``: nothing is imported to check it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROCESS_PACKAGES = ("target_server", "drafter_worker", "metrics_sidecar")
PACKAGES = ("common", *PROCESS_PACKAGES, "tools")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    """Project modules ``module`` imports anywhere in its file (resolved to the longest known name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    out = set()
    for name in names:
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            candidate = ".".join(parts[:end])
            if candidate in known:
                if candidate != module:
                    out.add(candidate)
                break
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(path, name, known) for name, path in modules.items()}


def _top(module: str) -> str:
    return module.split(".")[0]


def test_process_packages_never_import_each_other_and_common_imports_none():
    bad = []
    for module, deps in _graph().items():
        for dep in deps:
            src, dst = _top(module), _top(dep)
            if src == dst:
                continue
            if src in PROCESS_PACKAGES and dst in PROCESS_PACKAGES:
                bad.append(f"{module} -> {dep} (process packages never import one another)")
            if src == "common" and dst != "common":
                bad.append(f"{module} -> {dep} (common imports no process package or tool)")
            if src in PROCESS_PACKAGES and dst == "tools":
                bad.append(f"{module} -> {dep} (processes do not import tools)")
    assert not bad, "\n".join(sorted(bad))


def test_the_target_server_imports_no_drafter_model_code():
    for path in sorted((ROOT / "target_server").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith(("triton", "drafter_worker")), f"{path.relative_to(ROOT)} imports {name}"


def test_no_import_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for dep in graph.get(node, ()):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_rules_see_real_imports():
    # The checks above are only as good as the graph: it must see the edges we know exist.
    graph = _graph()
    assert "common.protocol" in graph["target_server.server"]
    assert "target_server.coordinator" in graph["target_server.server"]
    assert "drafter_worker.connection" in graph["drafter_worker.worker"]
