"""The house (DESIGN.md "Layout"): data flows one way, so every import between the package's parts points down.

    core → util → store, state → engine → entrypoint, integrations → cli  |  → bench → demo

A part may import its own modules and any part of a lower rank, never one of its own rank or above
(tests/core/test_layering.py adds that core imports nothing but the standard library and numpy). A
command module (a `cli.py`, `entrypoint/up.py`) is a leaf: only another command module imports it.
Lazy imports inside functions count: they are edges of the same graph.

The product is everything up to `cli`; the tools above it (the bench, and the demo, whose last step runs the
bench's simulator) use the product and are never used by it: `kvledger.cli` names them in one table, `TOOLS`, and
imports a tool's module only to run its command. The product runs without the `bench` extra (matplotlib, pyzmq,
openai).
"""

import ast
import subprocess
import sys
from pathlib import Path

import kvledger

PACKAGE = Path(kvledger.__file__).parent
RANK = {"core": 0, "util": 1, "store": 2, "state": 2, "engine": 3, "entrypoint": 4, "integrations": 4, "cli": 5,
        "bench": 6, "demo": 7, "__main__": 8, "__init__": 8}
COMMANDS = ("cli", "entrypoint.up")
TOOL_PARTS = ("bench", "demo")


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_command(module: str) -> bool:
    return module.endswith(".cli") or module.removeprefix("kvledger.") in COMMANDS


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _is_product(module: str) -> bool:
    return RANK[_part(module)] <= RANK["cli"]


def _edges():
    for path, module in _modules():
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


def test_the_product_imports_nothing_of_the_tools():
    """No import from a product module into bench or demo, lazy ones included; and no module name of theirs in the
    product's code (an `importlib.import_module` string) but the ones `kvledger.cli.TOOLS` runs."""
    from kvledger.cli import TOOLS

    into = [f"{path.relative_to(PACKAGE)}: {module} imports {name}" for path, module, name in _edges()
            if _is_product(module) and _part(name) in TOOL_PARTS]
    assert not into, "the product imports a tool:\n" + "\n".join(into)
    named = {}
    for path, module in _modules():
        if _is_product(module):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                        node.value.startswith(tuple(f"kvledger.{part}" for part in TOOL_PARTS)):
                    named.setdefault(module, set()).add(node.value)
    assert named == {"kvledger.cli": {tool.module for tool in TOOLS.values()}}


def test_the_product_runs_without_the_bench_extra():
    """The server, the product's whole command line and `kvledger plan` with matplotlib, pyzmq and openai
    absent (None in sys.modules reads as not installed), and no tool's module loaded."""
    from kvledger.cli import TOOLS

    code = ("import sys\n"
            f"for name in {TOOLS['bench'].needs!r}: sys.modules[name] = None\n"
            "import kvledger.entrypoint.server\n"
            "from kvledger.cli import build_parser, main\n"
            "build_parser(())\n"
            "assert main(['plan', '--tokens', '4096', '--json']) == 0\n"
            "loaded = sorted(m for m in sys.modules if m.startswith(('kvledger.bench', 'kvledger.demo')))\n"
            "print(loaded, file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == "[]"
