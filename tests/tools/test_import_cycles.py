"""No import cycles among the package's modules (moe_dispatcher, and integrations/ as
moe_dispatcher.integrations): the module import graph, read from the sources with ast, has no strongly connected
component of two modules or more. Imports inside functions count too: a cycle that only works because one side
imports lazily is still a cycle."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = (("moe_dispatcher", "moe_dispatcher"), ("integrations", "moe_dispatcher.integrations"))


def _modules() -> dict:
    """Module name -> (path, is a package __init__)."""
    mods = {}
    for folder, package in PACKAGES:
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([package, *parts])] = (path, path.name == "__init__.py")
    return mods


def _graph(mods: dict) -> dict:
    graph = {}
    for name, (path, is_package) in mods.items():
        package = name if is_package else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = anchor + ("." + node.module if node.module else "")
                if base in mods:
                    deps.add(base)
                deps.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods)
        # a module's own parent packages are imported by Python first anyway: not an edge
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}
    return graph


def _cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def test_no_import_cycles():
    graph = _graph(_modules())
    assert "moe_dispatcher.integrations.megatron.dispatcher" in graph and "moe_dispatcher.bench.report" in graph
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(
        " <-> ".join(c) + " (" + ", ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) + ")" for c in cycles)


def test_a_cycle_is_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
