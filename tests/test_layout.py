"""The repository's layout: one `loramux` package assembled from top-level folders.

platform/ has no __init__.py (it would shadow the standard library's `platform` when
Python runs from the repository root), pyproject's package list covers every folder, the
wheel ships the right files, and the README's two commands are the ones CI runs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# Folders whose every .py-holding subfolder must be a listed package.
CODE_FOLDERS = ("engine", "kernels", "platform", "benchmarks")

# Never copied into the throwaway build tree (large, or build outputs).
_BUILD_COPY_IGNORE = shutil.ignore_patterns(
    ".git",
    ".venv",
    ".pytest_cache",
    ".ruff_cache",
    ".loramux",
    "__pycache__",
    "*.egg-info",
    "build",
    "dist",
    "test-artifacts",
    "tests",
)


def _pyproject() -> dict:
    with (REPO_ROOT / "pyproject.toml").open("rb") as handle:
        return tomllib.load(handle)


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


# --- platform/ does not shadow the standard library ------------------------------------------


def test_stdlib_platform_and_loramux_platform_import_from_repo_root():
    result = _run_python("import platform, loramux.platform; print(platform.system())")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "platform.system() printed nothing"


def test_platform_resolves_to_the_stdlib_module_from_repo_root():
    result = _run_python("import platform; print(platform.__file__)")
    assert result.returncode == 0, result.stderr
    module_file = Path(result.stdout.strip()).resolve()
    assert module_file.name == "platform.py"
    assert not module_file.is_relative_to(REPO_ROOT / "platform"), module_file
    assert module_file.parent != REPO_ROOT


def test_platform_folder_has_no_init_py():
    assert (REPO_ROOT / "platform").is_dir()
    assert not (REPO_ROOT / "platform" / "__init__.py").exists()


# --- pyproject's package list ----------------------------------------------------------------


def test_package_dir_maps_the_code_folders():
    package_dir = _pyproject()["tool"]["setuptools"]["package-dir"]
    assert package_dir["loramux.engine"] == "engine"
    assert package_dir["loramux.kernels"] == "kernels"
    assert package_dir["loramux.platform"] == "platform"
    assert package_dir["loramux.benchmarks"] == "benchmarks"


def _dotted_name(folder: Path, package_dir: dict[str, str]) -> str:
    """Map a repository folder to its import name through package-dir."""
    relative = folder.relative_to(REPO_ROOT)
    best: tuple[str, Path] | None = None
    for package, directory in package_dir.items():
        base = Path(directory)
        inside = relative == base or relative.is_relative_to(base)
        if inside and (best is None or len(base.parts) > len(best[1].parts)):
            best = (package, base)
    assert best is not None, f"{relative} is not under any package-dir entry"
    package, base = best
    rest = relative.relative_to(base).parts
    return ".".join((package, *rest))


def test_packages_cover_every_code_folder():
    setuptools_table = _pyproject()["tool"]["setuptools"]
    package_dir = setuptools_table["package-dir"]
    listed = set(setuptools_table["packages"])

    expected = set()
    for top in CODE_FOLDERS:
        for py_file in (REPO_ROOT / top).rglob("*.py"):
            if "__pycache__" in py_file.parts:
                continue
            expected.add(_dotted_name(py_file.parent, package_dir))

    assert {"loramux.engine", "loramux.kernels", "loramux.platform"} <= expected
    missing = sorted(expected - listed)
    assert not missing, f"pyproject [tool.setuptools] packages lacks {missing}"


# --- the wheel -------------------------------------------------------------------------------


def test_wheel_ships_the_package_files(tmp_path):
    # Build from a copy so the build/ and *.egg-info outputs never land in the working tree.
    source = tmp_path / "src"
    shutil.copytree(REPO_ROOT, source, ignore=_BUILD_COPY_IGNORE, symlinks=True)
    wheel_dir = tmp_path / "wheels"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(wheel_dir),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    wheels = list(wheel_dir.glob("loramux-*.whl"))
    assert len(wheels) == 1, wheels

    with zipfile.ZipFile(wheels[0]) as wheel:
        names = set(wheel.namelist())
        entry_points_name = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        entry_points = wheel.read(entry_points_name).decode()

    for required in (
        "loramux/platform/cli.py",
        "loramux/platform/api/__init__.py",
        "loramux/engine/engine.py",
        "loramux/kernels/lora.py",
        "loramux/migrations/__init__.py",
        "loramux/admin_ui/__init__.py",
        "loramux/benchmarks/bench.py",
    ):
        assert required in names, f"{required} missing from the wheel"
    assert "loramux/platform/__init__.py" not in names
    assert not any(name.startswith("platform/") for name in names), "bare platform/ shipped"
    assert not any(name.startswith("loramux/benchmarks/results/") for name in names)

    # Every module of the code folders ships at its import path.
    for top in CODE_FOLDERS:
        for py_file in (REPO_ROOT / top).rglob("*.py"):
            if "__pycache__" in py_file.parts:
                continue
            shipped = "loramux/" + py_file.relative_to(REPO_ROOT).as_posix()
            assert shipped in names, f"{shipped} missing from the wheel"

    assert "loramux=loramux.platform.cli:main" in _entry_points(entry_points, "console_scripts")
    # `loramux bench`: platform/cli.py finds the benchmarks only through this entry point.
    commands = _entry_points(entry_points, "loramux.commands")
    assert "bench=loramux.benchmarks.bench:main" in commands, entry_points


def _entry_points(text: str, group: str) -> set[str]:
    """The entries of ``group`` in an entry_points.txt, without spaces."""
    section = re.search(rf"\[{re.escape(group)}\]\n(.*?)(?:\n\[|\Z)", text, re.S)
    assert section is not None, f"no [{group}] in:\n{text}"
    return {re.sub(r"\s+", "", line) for line in section.group(1).splitlines() if line.strip()}


# --- README and CI ---------------------------------------------------------------------------


def test_readme_opens_with_make_run_and_make_test():
    readme_path = REPO_ROOT / "README.md"
    assert readme_path.is_file(), "README.md is missing"
    readme = readme_path.read_text()
    lines = readme.splitlines()
    assert lines and lines[0].startswith("# "), "README must start with a title"

    # Everything up to the first section heading after the title.
    head: list[str] = []
    for line in lines[1:]:
        if re.match(r"#{1,6}\s", line):
            break
        head.append(line)
    head_text = "\n".join(head)

    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", head_text, re.S | re.M)
    assert blocks, "no code block before the first section heading"
    commands = {line.split("#")[0].strip() for block in blocks for line in block.splitlines()}
    assert "make run" in commands, blocks
    assert "make test" in commands, blocks

    # Title, then at most one short paragraph, then the code block.
    before_block = head_text.split("```", 1)[0]
    paragraphs = [p for p in re.split(r"\n\s*\n", before_block) if p.strip()]
    assert len(paragraphs) <= 1, f"more than one paragraph before the commands: {paragraphs}"


def test_the_front_page_links_every_docs_page_and_every_link_resolves():
    readme = (REPO_ROOT / "README.md").read_text()
    pages = sorted(p.name for p in (REPO_ROOT / "docs").glob("*.md"))
    assert pages, "docs/ has no pages"
    for page in pages:
        assert f"](docs/{page})" in readme, f"README.md does not link docs/{page}"
    for path in [REPO_ROOT / "README.md", *(REPO_ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)\)", path.read_text()):
            if "://" in target:
                continue
            resolved = (path.parent / target).resolve()
            assert resolved.exists(), (
                f"{path.relative_to(REPO_ROOT)} links {target}, which is not there"
            )


def test_ci_runs_make_test():
    script = (REPO_ROOT / ".ci" / "run").read_text()
    commands = [
        line.strip()
        for line in script.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    assert "make test" in commands, script
