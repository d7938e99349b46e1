"""The platform reaches the engine only through ``loramux.engine``'s exports.

Every ``import`` in ``platform/`` of engine code names the package itself, never one of its
modules, so the engine's modules can move without breaking the platform; and what the
platform imports from it is in its ``__all__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import loramux.engine

PLATFORM = Path(__file__).resolve().parents[2] / "platform"


def _engine_imports():
    """(file, line, module, names) of every import of engine code in platform/."""
    for path in sorted(PLATFORM.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "loramux.engine"
            ):
                yield path, node.lineno, node.module, [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("loramux.engine"):
                        yield path, node.lineno, alias.name, []


def test_platform_imports_only_the_engines_front_door():
    found = list(_engine_imports())
    assert found, "the platform imports nothing from the engine? the walk is broken"
    inside = [
        f"{path.relative_to(PLATFORM.parent)}:{line} imports {module}"
        for path, line, module, _ in found
        if module != "loramux.engine"
    ]
    assert not inside, "import these from loramux.engine instead:\n" + "\n".join(inside)


def test_what_the_platform_imports_is_exported():
    exported = set(loramux.engine.__all__)
    used = {name for _, _, _, names in _engine_imports() for name in names}
    assert used <= exported, f"imported but not in loramux.engine.__all__: {used - exported}"
