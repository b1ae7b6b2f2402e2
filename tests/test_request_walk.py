"""docs/development.md walks one request file by file: every `file.py:function` it names is still there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "development.md"
NAME = re.compile(r"`([a-z_/]+\.py)(?::([A-Za-z_][\w.]*))?`")


def walk_section() -> str:
    text = DOC.read_text()
    start = text.index("## The path of one request")
    return text[start:text.index("\n## ", start + 1)]


def qualnames(path: Path) -> set[str]:
    """Every class and function a module defines, by qualified name (`Class.method`, `outer.<locals>.inner` as
    `outer.inner`)."""
    names: set[str] = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(prefix + child.name)
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text()), "")
    return names


def test_every_file_and_function_the_walk_names_exists():
    named = NAME.findall(walk_section())
    assert len({f for f, _ in named}) >= 40, "the walk names the files of an embedded and a cluster request"
    missing = []
    for file, func in named:
        path = ROOT / file if file.startswith(("scripts/", "tests/")) else ROOT / "kvledger" / file
        if not path.is_file():
            missing.append(file)
        elif func and func not in qualnames(path):
            missing.append(f"{file}:{func}")
    assert not missing, f"docs/development.md names what is gone: {missing}"


def test_the_walk_finds_a_name_that_is_gone():
    """The check can fail: a made-up function in a real file is reported."""
    assert "Engine.add_request" in qualnames(ROOT / "kvledger" / "engine" / "engine.py")
    assert "Engine.add_requests" not in qualnames(ROOT / "kvledger" / "engine" / "engine.py")
