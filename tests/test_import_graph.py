"""The package's import graph: no circles, and the low-level modules never import the model.

Every import of an `hf_elmo` module counts, at module level or inside a function (a lazy import is still an
arrow a reader must follow), read from the source with `ast`, so nothing is imported to find them.
"""

import ast
from pathlib import Path

import pytest


PACKAGE = Path(__file__).resolve().parent.parent / "hf_elmo"
# What the model uses from the package (its `package_module` imports). None of these may import the model, or anything
# that does.
LOW_LEVEL = {"cpu_tuning", "token_cache", "int8_weights", "sampled_softmax", "log_uniform_sampler", "weight_checks",
             "atomic_file", "elmo_presets"}
MODEL = "modeling_elmo"
# The tuned implementations are built on the model's maths, so they import it; the registry in the config loads them
# by name (`import_built_in_implementations`, when a model is built), and the model never imports them.
IMPLEMENTATIONS = {"cpu": "elmo_cpu", "cuda": "elmo_cuda"}


def imported_modules(path: Path) -> set[str]:
    """The `hf_elmo` modules that `path` imports, by name within the package."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:  # from .x import y
                found.add(node.module.split(".")[0])
            elif node.level == 1:  # from . import x
                found.update(alias.name for alias in node.names)
            elif node.level == 0 and (node.module or "").startswith("hf_elmo."):
                found.add(node.module.split(".")[1])
            elif node.level == 0 and node.module == "hf_elmo":
                found.update(alias.name for alias in node.names if (PACKAGE / f"{alias.name}.py").exists())
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[1] for alias in node.names if alias.name.startswith("hf_elmo."))
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "package_module" and node.args
              and isinstance(node.args[0], ast.Constant)):  # modeling_elmo's imports of what a saved folder lacks
            found.add(node.args[0].value)
    return {name for name in found if (PACKAGE / f"{name}.py").exists()}


def import_graph() -> dict[str, set[str]]:
    return {path.stem: imported_modules(path) - {path.stem} for path in sorted(PACKAGE.glob("*.py"))}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for name in graph[stack.pop()]:
            if name not in seen:
                seen.add(name)
                stack.append(name)
    return seen


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports (as the modules along it, first repeated at the end), or None."""
    state, path = {}, []

    def visit(name):
        state[name] = "open"
        path.append(name)
        for imported in sorted(graph[name]):
            if state.get(imported) == "open":
                return path[path.index(imported):] + [imported]
            if imported not in state:
                circle = visit(imported)
                if circle:
                    return circle
        state[name] = "done"
        path.pop()
        return None

    for name in sorted(graph):
        if name not in state:
            circle = visit(name)
            if circle:
                return circle
    return None


def test_the_graph_is_read_from_real_imports():
    graph = import_graph()
    # Arrows this test must see, of each kind: module-level relative, lazy, and the model's use of the low level.
    assert {"configuration_elmo", "token_cache", "int8_weights", "weight_checks"} <= graph[MODEL]
    assert "tokenization_elmo" in graph[MODEL]  # inside save_pretrained
    assert "configuration_elmo" in graph["tokenization_elmo"]
    assert {MODEL, "elmo_ops"} <= graph["elmo_cpu"]
    assert LOW_LEVEL <= set(graph)


def test_the_finder_reports_a_circle():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_import_circle():
    circle = find_circle(import_graph())
    assert circle is None, "import circle: " + " -> ".join(circle)


@pytest.mark.parametrize("module", sorted(LOW_LEVEL))
def test_low_level_modules_never_import_the_model(module):
    graph = import_graph()
    assert MODEL not in reachable(graph, module), f"{module} imports {MODEL} (directly or through another module)"


def test_the_implementations_import_the_model_not_each_other_and_the_model_not_them():
    graph = import_graph()
    assert "elmo_cuda" not in reachable(graph, "elmo_cpu")
    assert "elmo_cpu" not in reachable(graph, "elmo_cuda")
    assert graph["elmo_ops"] == {MODEL, "cpu_tuning"}  # the model's LSTM step; the products handed to oneDNN
    for module in (*IMPLEMENTATIONS.values(), "elmo_ops"):
        assert module not in reachable(graph, MODEL)


def test_the_registry_loads_each_built_in_implementation_from_its_module():
    from hf_elmo import configuration_elmo

    source = (PACKAGE / "configuration_elmo.py").read_text(encoding="utf-8")
    assert 'package_module(f"elmo_{name}")' in source  # the one import the graph above cannot read
    for name, module in IMPLEMENTATIONS.items():
        assert (PACKAGE / f"{module}.py").exists()
        assert f'register("{name}"' in (PACKAGE / f"{module}.py").read_text(encoding="utf-8")
    assert set(IMPLEMENTATIONS) | {"reference"} == set(configuration_elmo.BUILT_IN_NAMES)

