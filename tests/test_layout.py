"""The package's house rules, read from its source (docs/development.md, "A map of the
house"): imports go one way (no two modules import each other, however indirectly), no test
machinery in the package, and functions short enough to read at once."""

import ast
import pathlib

from conftest import PLUGIN_DIR

PACKAGE = pathlib.Path(PLUGIN_DIR)
MAX_LINES, MAX_PARAMETERS = 60, 7
# the exceptions, each an interface someone else defined
LONG_SIGNATURES = {
    # fairseq's FairseqIncrementalDecoder.forward, as SequenceGenerator and the hub call it
    "models/decoder.py:AnnotatedTransformerDecoder.forward",
    # the notebook's make_model(src_vocab, tgt_vocab, N, d_model, d_ff, h, dropout), + pre_ln
    "reference.py:make_model",
}


def modules():
    """{dotted name: parsed source} of every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("fairseq_plugin",) + path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = (path, ast.parse(path.read_text()))
    return found


def imported(name, path, tree, names):
    """The package's modules that ``name`` imports, anywhere in it (in a function too)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            submodules = {f"{target}.{a.name}" for a in node.names} & names
            out.update(submodules or ({target} & names))
    return out - {name}


def cycles(graph):
    """The import cycles of ``graph``, each as a list of modules (a depth-first search)."""
    found, state = [], {}  # state: 1 while on the path, 2 when done

    def visit(module, path):
        state[module] = 1
        for other in sorted(graph[module]):
            if state.get(other) == 1:
                found.append(path[path.index(other):] + [other])
            elif other not in state:
                visit(other, path + [other])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def test_no_two_modules_import_each_other():
    found = modules()
    graph = {name: imported(name, path, tree, set(found)) for name, (path, tree) in found.items()}
    assert graph["fairseq_plugin.cli.prepare"] >= {"fairseq_plugin.cli.streaming"}  # (it reads)
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_test_machinery_in_the_package():
    for name, (path, tree) in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.split(".")[0] in ("unittest", "pytest") for n in names), \
                    f"{path}:{node.lineno}"


def test_functions_are_short_and_take_few_parameters():
    too_long, seen = [], set()
    for name, (path, tree) in modules().items():
        where = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                qualified = (f"{node.name}.{child.name}" if isinstance(node, ast.ClassDef)
                             else child.name)
                seen.add(f"{where}:{qualified}")
                a = child.args
                parameters = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
                count = sum(p is not None and p.arg not in ("self", "cls") for p in parameters)
                lines = child.end_lineno - child.lineno + 1
                if lines > MAX_LINES or (count > MAX_PARAMETERS
                                         and f"{where}:{qualified}" not in LONG_SIGNATURES):
                    too_long.append(f"{where}:{qualified}: {lines} lines, {count} parameters")
    assert too_long == []
    assert LONG_SIGNATURES <= seen  # (no exception outlives its function)
