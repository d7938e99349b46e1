"""Where the benchmarks write their results and cache their models, and how they write.

From a source checkout, results go to its ``benchmarks/results/`` (where the recorded
results are committed) and models and adapters are cached in its
``.loramux/bench-cache/``. An installed loramux has no results folder: a run then needs
``--out DIR`` and says so, and it caches under ``./.loramux/bench-cache/``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # benchmarks/, this module being in common/
# The source checkout this package runs from (None for an installed package).
CHECKOUT = PACKAGE_DIR.parent if (PACKAGE_DIR.parent / "pyproject.toml").is_file() else None
RESULTS_DIR = PACKAGE_DIR / "results"
NO_RESULTS_DIR = (
    "this loramux is installed without its source checkout, so there is no "
    "benchmarks/results folder to write to: pass --out DIR"
)


def default_cache_dir() -> Path:
    return (CHECKOUT or Path.cwd()) / ".loramux" / "bench-cache"


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """``--out`` (the results folder) and ``--cache-dir`` (models, adapters)."""
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS_DIR if RESULTS_DIR.is_dir() else None,
        help="results folder (default: the checkout's benchmarks/results)",
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=default_cache_dir(), help="models and adapters"
    )


def check_output_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.out is None:
        parser.error(NO_RESULTS_DIR)


def fill_sizes(args: argparse.Namespace, sizes: dict[str, dict]) -> None:
    """The options left unset take the run's size's values (``sizes["smoke"]`` with
    ``--smoke``, else ``sizes["full"]``)."""
    for name, value in sizes["smoke" if args.smoke else "full"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def check_sized(
    parser: argparse.ArgumentParser, args: argparse.Namespace, sizes: dict, positive: tuple
) -> None:
    """``--out`` given; the options left unset take the run's size's values (``fill_sizes``);
    each option named in ``positive`` (every value, for a list; None is unset) above zero,
    else a usage error naming those that are not."""
    check_output_options(parser, args)
    fill_sizes(args, sizes)

    def low(value) -> bool:
        return value is not None and min(value if isinstance(value, list) else [value]) <= 0

    bad = ["--" + name.replace("_", "-") for name in positive if low(getattr(args, name))]
    if bad:
        parser.error(f"{', '.join(bad)} must be positive")


def link_or_copy(source: str, target: str) -> None:
    """A hard link where ``source`` and ``target`` share a file system (a model's hundreds of
    MB cost nothing), else a copy: ``shutil.copytree``'s ``copy_function``."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path``, which never holds a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(text)
    staging.replace(path)


def publish_folder(staging: Path, target: Path, made: Callable[[], bool]) -> None:
    """Rename the complete folder ``staging`` onto ``target``, so ``target`` appears whole or
    not at all. Another process may make the same folder at once (the suite's two workers
    on one cache): when ``made()`` says ``target`` is complete, it is that process's, which
    may already be read, so it is kept and ``staging`` dropped. An incomplete ``target``
    (a run that died) is replaced."""
    try:
        if made():
            return
        shutil.rmtree(target, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:  # another process's complete folder got there in between
            if not made():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def pyplot():
    """matplotlib's pyplot on the file-only backend, or None (said on stderr) without it."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plots are drawn", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, *, note: str | None = None, dpi: int = 110) -> Path:
    """``fig`` laid out and written to ``path`` (a grey ``note`` in its lower left), closed."""
    if note:
        fig.text(0.01, 0.01, note, fontsize=8, color="gray")
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    import matplotlib.pyplot as plt  # a figure exists, so pyplot() has set it up

    plt.close(fig)
    return path
