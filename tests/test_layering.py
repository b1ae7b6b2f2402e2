"""The house (DESIGN.md "Layout"): data flows one way, so every import between the package's parts points down.

    core → util → store, state → engine → entrypoint, integrations → bench → demo → cli

A part may import its own modules and any part of a lower rank, never one of its own rank or above
(tests/core/test_layering.py adds that core imports nothing but the standard library and numpy). A
command module (a `cli.py`, `entrypoint/up.py`) is a leaf: only another command module imports it.
Lazy imports inside functions count: they are edges of the same graph.
"""

import ast
from pathlib import Path

import kvledger

PACKAGE = Path(kvledger.__file__).parent
RANK = {"core": 0, "util": 1, "store": 2, "state": 2, "engine": 3, "entrypoint": 4, "integrations": 4, "bench": 5,
        "demo": 6, "cli": 7, "__main__": 8, "__init__": 8}
COMMANDS = ("cli", "entrypoint.up")


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_command(module: str) -> bool:
    return module.endswith(".cli") or module.removeprefix("kvledger.") in COMMANDS


def _edges():
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            else:
                continue
            yield from ((path, module, n) for n in names if n == "kvledger" or n.startswith("kvledger."))


def test_every_part_of_the_package_has_a_rank():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert parts == set(RANK), f"rank these in the house: {parts - set(RANK)}; gone: {set(RANK) - parts}"


def test_imports_point_down():
    up = [f"{path.relative_to(PACKAGE)}: {module} imports {name}" for path, module, name in _edges()
          if _part(name) != _part(module) and RANK[_part(name)] >= RANK[_part(module)]]
    assert not up, "imports against the flow:\n" + "\n".join(up)


def test_command_modules_are_leaves():
    into = [f"{path.relative_to(PACKAGE)}: {module} imports {name}" for path, module, name in _edges()
            if _is_command(name) and not _is_command(module) and module != "kvledger.__main__"]
    assert not into, "only a command imports a command:\n" + "\n".join(into)
