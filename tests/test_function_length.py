"""No function in ``packages/*/src`` is longer than a page and a half (150 lines).

Why: a step that reads as a story is one whose phases are named; a 300-line function (the old
``trainer._train``) hides them. A function that must be longer is listed in ``ALLOWED`` with the
reason, so the exception is a decision, not an accident.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 150
ALLOWED: dict[str, str] = {}  # "path::name" -> why it stays long


def _long_functions(root: Path = ROOT) -> list[str]:
    found = []
    for path in sorted(root.glob("packages/*/src/**/*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                key = f"{path.relative_to(root)}::{node.name}"
                if length > LIMIT and key not in ALLOWED:
                    found.append(f"{key}: {length} lines")
    return found


def test_no_function_is_longer_than_the_limit() -> None:
    assert _long_functions() == []


def test_the_check_sees_a_long_function(tmp_path: Path) -> None:
    src = tmp_path / "packages" / "p" / "src" / "p"
    src.mkdir(parents=True)
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (src / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert _long_functions(tmp_path) == ["packages/p/src/p/m.py::long: 151 lines"]
