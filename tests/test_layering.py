"""The layers' import rules: platform → engine → kernels, and the product never imports the
benchmarks.

design.md: "Dependencies point one way: platform → engine → kernels." The benchmarks drive
the product from outside (``loramux bench`` finds them through an entry point). Each rule is
checked twice: every import statement of the layer's files (at module level or inside a
function; relative ones resolved), each violation named by file and line; and a fresh
interpreter that imports every module of the layer, after which none of the forbidden
modules may be loaded (an import no statement shows: importlib, a dependency's).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Rule:
    name: str
    folders: tuple[str, ...]  # repository folders the rule covers
    forbidden: tuple[str, ...]  # packages none of their modules may import
    packages: tuple[str, ...]  # their import packages (every module imported in the probe)


RULES = (
    Rule("engine", ("engine",), ("loramux.platform", "loramux.benchmarks"), ("loramux.engine",)),
    Rule(
        "kernels",
        ("kernels",),
        ("loramux.engine", "loramux.platform", "loramux.benchmarks"),
        ("loramux.kernels",),
    ),
    Rule(
        "platform",
        ("platform", "admin_ui", "migrations"),
        ("loramux.benchmarks",),
        ("loramux.platform", "loramux.admin_ui", "loramux.migrations"),
    ),
)

# Modules the probe does not import: they run when imported (a process's main; Alembic's
# env.py migrates a database). Their import statements are still checked.
NOT_IMPORTED = ("__main__", "loramux.migrations.env")


def _package_dir() -> dict[str, str]:
    with (REPO_ROOT / "pyproject.toml").open("rb") as handle:
        return tomllib.load(handle)["tool"]["setuptools"]["package-dir"]


def _module_name(path: Path) -> str:
    """``path``'s import name, through pyproject's package-dir (an __init__.py: its
    package's)."""
    relative = path.relative_to(REPO_ROOT).with_suffix("")
    for package, folder in _package_dir().items():
        if relative.parts[0] == folder:
            parts = relative.parts[1:]
            if parts and parts[-1] == "__init__":
                parts = parts[:-1]
            return ".".join((package, *parts))
    raise AssertionError(f"{path} is in no package of pyproject's package-dir")


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a ``from ... import`` names, a relative one resolved against ``module``."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    up = node.level - 1
    if up >= len(package):
        raise AssertionError(f"{module}: relative import beyond the top package")
    base = ".".join(package[: len(package) - up])
    return f"{base}.{node.module}" if node.module else base


def imports_in(source: str, module: str, *, is_package: bool = False) -> Iterator[tuple[int, str]]:
    """(line, absolute name) of every module each import statement of ``source`` may load;
    ``from a import b`` names both ``a`` and ``a.b`` (b may be a submodule)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            yield node.lineno, base
            for alias in node.names:
                if alias.name != "*":
                    yield node.lineno, f"{base}.{alias.name}"


def _is_in(name: str, packages: tuple[str, ...]) -> str | None:
    """The package of ``packages`` that ``name`` is, or is inside; None if none."""
    return next((p for p in packages if name == p or name.startswith(p + ".")), None)


def _python_files(rule: Rule) -> list[Path]:
    return sorted(
        path
        for folder in rule.folders
        for path in (REPO_ROOT / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    )


def violations(rule: Rule) -> list[str]:
    """'file:line imports name' for every import of ``rule``'s folders it forbids."""
    found: dict[tuple[str, int], str] = {}  # (file, line) -> the longest name it imports
    for path in _python_files(rule):
        module = _module_name(path)
        is_package = path.name == "__init__.py"
        for line, name in imports_in(path.read_text(), module, is_package=is_package):
            where = (str(path.relative_to(REPO_ROOT)), line)
            if _is_in(name, rule.forbidden) and len(name) > len(found.get(where, "")):
                found[where] = name
    return [
        f"{file}:{line} imports {name} (in {_is_in(name, rule.forbidden)})"
        for (file, line), name in sorted(found.items())
    ]


@pytest.mark.parametrize("rule", RULES, ids=[rule.name for rule in RULES])
def test_no_import_statement_crosses_the_layers(rule):
    assert _python_files(rule), f"no Python files in {rule.folders}: the walk is broken"
    found = violations(rule)
    assert not found, (
        f"{'/, '.join(rule.folders)}/ must not import {', '.join(rule.forbidden)}:\n"
        + "\n".join(found)
    )


_PROBE = """
import importlib, json, pkgutil, sys

packages, forbidden, not_imported = json.loads(sys.argv[1])

def is_forbidden(name):
    return any(name == f or name.startswith(f + ".") for f in forbidden)

def skipped(name):
    return any(name == s or name.endswith("." + s) for s in not_imported)

first_loaded_by = {}  # forbidden module -> the module whose import loaded it
imported = 0
for top in packages:
    names = [top]
    package = importlib.import_module(top)
    names += [m.name for m in pkgutil.walk_packages(package.__path__, top + ".")]
    for name in names:
        if skipped(name):
            continue
        importlib.import_module(name)
        imported += 1
        for loaded in list(sys.modules):
            if is_forbidden(loaded) and loaded not in first_loaded_by:
                first_loaded_by[loaded] = name
print(json.dumps({"imported": imported, "forbidden": first_loaded_by}))
"""


@pytest.mark.parametrize("rule", RULES, ids=[rule.name for rule in RULES])
def test_importing_a_layer_loads_nothing_it_may_not_import(rule):
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            _PROBE,
            json.dumps([rule.packages, rule.forbidden, NOT_IMPORTED]),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    assert result["imported"] > len(rule.packages), result  # the walk found the modules
    loaded = [f"{name} (first loaded by {by})" for name, by in result["forbidden"].items()]
    assert not loaded, (
        f"importing every module of {', '.join(rule.packages)} loads what "
        f"{rule.name} may not import:\n" + "\n".join(sorted(loaded))
    )


def test_the_platform_never_names_the_benchmarks():
    """Not even in a string (importlib, an entry point's target): ``loramux bench`` finds
    them through the ``loramux.commands`` entry point pyproject.toml declares."""
    named = [
        f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}"
        for path in _python_files(RULES[2])
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if "loramux.benchmarks" in line
    ]
    assert not named, "the product names the benchmarks:\n" + "\n".join(named)


# --- the checks themselves -------------------------------------------------------------------


def test_imports_are_found_inside_functions_and_relative_ones_resolved():
    source = (
        "import os\n"
        "from . import sibling\n"
        "def later():\n"
        "    from ...platform import settings\n"
        "    import loramux.benchmarks.bench\n"
        "class Late:\n"
        "    def method(self):\n"
        "        from ...benchmarks.bench import main\n"
        "from .. import kv_cache\n"
    )
    found = set(imports_in(source, "loramux.engine.lora.pool"))
    assert {
        (1, "os"),
        (2, "loramux.engine.lora.sibling"),
        (4, "loramux.platform.settings"),
        (5, "loramux.benchmarks.bench"),
        (8, "loramux.benchmarks.bench.main"),
        (9, "loramux.engine.kv_cache"),
    } <= found
    # In a package's __init__.py, "." is the package itself.
    assert (1, "loramux.engine.lora.pool") in set(
        imports_in("from .pool import LoRAPool\n", "loramux.engine.lora", is_package=True)
    )


def test_every_layer_is_a_package_of_pyproject():
    package_dir = _package_dir()
    for rule in RULES:
        for folder, package in zip(rule.folders, rule.packages, strict=True):
            assert package_dir[package] == folder
