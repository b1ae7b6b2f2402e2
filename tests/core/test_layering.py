"""`core` is pure: no I/O, no network, no torch, and nothing of the other kvledger packages."""

import ast
import subprocess
import sys
from pathlib import Path

import kvledger.core

CORE = Path(kvledger.core.__file__).parent
ALLOWED = {"__future__", "array", "collections", "dataclasses", "enum", "functools", "hashlib", "json", "math",
           "struct", "sys", "typing", "numpy"}
FORBIDDEN_CALLS = {"open", "print", "input", "exec", "eval"}


def _imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.module or ""


def test_core_imports_only_pure_modules():
    for path in CORE.glob("*.py"):
        tree = ast.parse(path.read_text())
        for name in _imports(tree):
            top = name.split(".")[0]
            if top == "kvledger":
                assert name.startswith("kvledger.core"), f"{path.name} imports {name}"
            else:
                assert top in ALLOWED, f"{path.name} imports {name}"
        calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert not calls & FORBIDDEN_CALLS, f"{path.name} calls {calls & FORBIDDEN_CALLS}"


def test_importing_core_loads_nothing_else():
    code = ("import sys, kvledger.core; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'rich', 'tokenizers', 'gguf', 'socket', 'numpy') or "
            "(m.startswith('kvledger.') and not m.startswith('kvledger.core'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
