"""The package's layout: no import cycles among specft's modules, counting the imports
inside functions too (a deferred import hides a cycle, it does not remove it)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "specft"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:  # relative: from the importing module's package up
        up = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([base] if base else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def import_graph() -> dict[str, set[str]]:
    """Module -> the specft modules it imports; importing a.b.c also runs package a.b's
    __init__, an edge unless the importer lives in that package."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: set() for name in paths}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or getattr(node, "module", None) == "__future__":
                continue
            for target in _imported(node, package):
                parts = target.split(".")
                for i in range(2, len(parts) + 1):
                    dep = ".".join(parts[:i])
                    inside = name == dep or name.startswith(dep + ".")
                    if dep in graph and not inside:
                        graph[name].add(dep)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


CONF = PACKAGE / "conf"
OPTIONS = [(group.name, yaml.stem) for group in sorted(CONF.iterdir()) if group.is_dir()
           for yaml in sorted(group.glob("*.yaml"))]


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_shipped_option_composes_and_validates(group, option):
    """Every YAML of every config group composes with the defaults and passes validation
    (file-reading data sources get a path, the mix source a member, multinode a hostfile)."""
    from helpers import root_cfg

    extra = []
    if group == "data" and option not in ("synthetic", "mix"):
        extra = ["data.path=somewhere.jsonl"]
    if group == "data" and option == "mix":
        extra = ["data.mix=[{name: gsm8k, path: a.jsonl, num_samples: 3}]"]
    if group == "trainer" and option == "multinode":  # the hostfile must exist
        extra = [f"trainer.hostfile={CONF / 'trainer' / 'hostfile.example'}"]
    checkpoints = PACKAGE.parent / "tests" / "fixtures" / "checkpoints" / "tiny_qwen3"
    if (group, option) == ("model", "hf"):  # facts come from a checkpoint
        extra = [f"model.path={checkpoints / 'fp8_dynamic'}", "quant=checkpoint"]
    if (group, option) == ("quant", "checkpoint"):
        extra = ["model=hf", f"model.path={checkpoints / 'fp8_dynamic'}"]
    cfg = root_cfg(f"{group}={option}", *extra)
    assert getattr(cfg, group) is not None


DESIGN = PACKAGE.parent / "docs" / "design.md"


def design_layers() -> dict[str, int]:
    """docs/design.md's layer list: each package or top-level module of specft -> its
    layer's rank (lowest first)."""
    text = DESIGN.read_text()
    block = text[text.index("<!-- layers -->"):text.index("<!-- /layers -->")]
    layers = {}
    for line in block.splitlines()[1:]:
        rank, _, names = line.partition(". ")
        names = names.split(":", 1)[-1]
        layers.update({name.strip(): int(rank) for name in names.split(",")})
    return layers


def _top(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    return [f"{module} -> {dep}" for module, deps in sorted(graph.items()) for dep in sorted(deps)
            if _top(module) != _top(dep) and layers[_top(dep)] > layers[_top(module)]]


def test_every_package_and_module_has_a_layer_in_the_design():
    missing = {_top(m) for m in import_graph() if m != "specft"} - set(design_layers())
    assert not missing, f"add to docs/design.md's layer list: {', '.join(sorted(missing))}"


def test_no_import_points_up_the_layers():
    """An upward import (deferred ones included) is a layer calling back into one above it."""
    upward = upward_imports(import_graph(), design_layers())
    assert not upward, "imports up the layers of docs/design.md:\n" + "\n".join(upward)


def test_the_layer_check_finds_an_upward_import():
    layers = {"errors": 1, "data": 11, "engines": 9}
    graph = {"specft.engines.x": {"specft.data", "specft.errors"}, "specft.data.y": {"specft.engines"}}
    assert upward_imports(graph, layers) == ["specft.engines.x -> specft.data"]
