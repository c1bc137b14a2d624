"""The shape of the code, checked: its import graph, the length of its functions, its lines.

Read from the sources with ``ast``, so that a change that breaks a rule fails here, not in
a reviewer's reading. An import counts wherever it is written (module level or inside a
function: a lazy import is a dependency too); only ``if TYPE_CHECKING:`` blocks, which never
run, are left out. A string constant that is the dotted name of a sharedmp module (what
``importlib`` is given) counts as an import of it.
"""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "sharedmp"
# The application and the command line sit on the library; the library never on them.
APPLICATION = ("sharedmp.hogwild", "sharedmp.training", "sharedmp.distributed", "sharedmp.cli",
               "sharedmp.__main__")
MAX_FUNCTION_LINES = 60


def _module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_nodes(tree):
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _targets(module, path, node):
    """The sharedmp modules an import node (or a string constant) of ``module`` names."""
    if isinstance(node, ast.Constant):
        value = node.value
        named = isinstance(value, str) and value.startswith("sharedmp.") and value in MODULES
        return [value] if named else []
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    if node.level:
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    # ``from X import name``: the submodule X.name if there is one, else X itself.
    found = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source
             for a in node.names]
    return [m for m in found if m in MODULES]


def import_graph():
    graph = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        edges = set()
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom, ast.Constant)):
                continue
            edges.update(m for m in _targets(module, path, node) if m != module)
        graph[module] = edges
    return graph


def _cycles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_lazy_imports_and_module_names():
    # The checks below are only as good as the graph: it must see what they are about.
    graph = import_graph()
    assert "sharedmp.reductions.torch.tensors" in graph["sharedmp.registry"]   # a string constant
    assert "sharedmp.reductions.cuda" in graph["sharedmp.reductions.torch.tensors"]  # lazy
    assert "sharedmp.wire" in graph["sharedmp.channels.connection"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_import_graph_has_no_cycle():
    cycles = _cycles(import_graph())
    assert not cycles, f"import cycles (module-level or lazy): {cycles}"


def _unit(module):
    """A folder of the package (``sharedmp.memory.segment`` -> ``memory``), or a module at
    its top (``sharedmp.wire``); the package's ``__init__`` is ``sharedmp``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "sharedmp"
    return parts[1] if (PACKAGE / parts[1]).is_dir() else module


def folder_graph(graph=None):
    units = {}
    for module, targets in (graph or import_graph()).items():
        edges = units.setdefault(_unit(module), set())
        edges.update(_unit(t) for t in targets if _unit(t) != _unit(module))
    return units


# Bottom to top: each may import what is on its own line (no cycle: below) or lower.
LAYERS = [
    {"sharedmp._compat", "sharedmp.errors", "sharedmp.fds", "sharedmp.forks", "sharedmp.host",
     "sharedmp.settings", "sharedmp.native"},
    {"sharedmp.strategy"},
    {"memory"},                                   # segments, arenas, the daemon
    {"sharedmp.wire"},                            # the message format
    {"cuda"},
    {"reductions"},                               # what a value becomes on the wire
    {"channels"},                                 # fds over sockets, connections, queues
    {"processes"},                                # contexts, pdeath, spawn()
    {"sharedmp.arrays", "datasets", "sharedmp.registry", "sharedmp.joblib"},
    {"sharedmp"},                                 # the public API
    {"hogwild", "sharedmp.training", "sharedmp.distributed", "cli", "sharedmp.__main__"},
]


def test_no_cycle_between_folders():
    cycles = _cycles(folder_graph())
    assert not cycles, f"folders (or top modules) that import each other, maybe through others: {cycles}"
    # (seen: a cycle through two folders of otherwise acyclic modules)
    assert _cycles(folder_graph({"sharedmp.channels.context": {"sharedmp.processes.pdeath"},
                                 "sharedmp.processes.spawn": {"sharedmp.channels.context"},
                                 "sharedmp.processes.pdeath": set()})) == [["channels", "processes"]]


def test_every_import_goes_down_the_layers():
    graph = folder_graph()
    layer = {unit: i for i, units in enumerate(LAYERS) for unit in units}
    assert set(graph) == set(layer), f"units not in LAYERS (or gone): {set(graph) ^ set(layer)}"
    up = sorted(f"{u} -> {t}" for u, targets in graph.items() for t in targets
                if layer[t] > layer[u])
    assert not up, f"imports up a layer: {up}"


def _is_application(module):
    return any(module == a or module.startswith(a + ".") for a in APPLICATION)


def test_the_library_imports_neither_the_application_nor_the_cli():
    bad = {m: sorted(t for t in targets if _is_application(t))
           for m, targets in import_graph().items() if not _is_application(m)}
    bad = {m: t for m, t in bad.items() if t}
    assert not bad, f"library modules that import the application or the CLI: {bad}"


def test_reducers_never_import_the_channels():
    graph = import_graph()
    bad = {m: sorted(t for t in graph[m] if t.startswith("sharedmp.channels"))
           for m in graph if m.startswith("sharedmp.reductions")}
    bad = {m: t for m, t in bad.items() if t}
    assert not bad, f"reducers that import the channels (use sharedmp.wire): {bad}"


def _functions():
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield module, node


def test_no_function_is_longer_than_60_lines():
    long = [f"{m}.{n.name} ({n.end_lineno - n.lineno + 1} lines, line {n.lineno})"
            for m, n in _functions() if n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_ruff_finds_no_long_line_and_no_unused_name():
    # The rules are pyproject.toml's [tool.ruff]: lines under 100 characters, pyflakes.
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
