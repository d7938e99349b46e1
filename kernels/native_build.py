"""Building the CPU's native ops (``csrc/*.c``) once per machine and loading them with ctypes.

:func:`load_native_library` compiles a C file with the system's C compiler (``cc``, or
``$CC``) into ``$XDG_CACHE_HOME/loramux/native/`` (default ``~/.cache``), named by a hash of
the source (and the headers beside it), the flags, the compiler and the CPU's features, so a machine builds it once
(about a second) and a changed source or CPU builds anew; the library is written under a
temporary name and renamed, so a concurrent process never loads half a file. Where no
compiler works, it returns None with the reason and the engine uses the torch ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
# -march=native: the library is built on the machine that runs it (the cache key has the
# CPU's features). No -ffast-math: NaN and inf must propagate (an adapter's bad weights
# are detected downstream by the non-finite outputs they cause).
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11")


def load_native_library(
    source: Path, cache_dir: Path | None = None
) -> tuple[ctypes.CDLL | None, str]:
    """``source`` built here if needed and loaded; or None and why it is not available."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler (cc, gcc or $CC) on this machine"
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"the C compiler {compiler!r} does not run: {exc}"
    # The headers beside it count: a changed shared header builds every library anew.
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256(
        b"\0".join(
            [source.read_bytes(), *headers, " ".join(FLAGS).encode(), version.encode(), _cpu()]
        )
    ).hexdigest()[:16]
    path = (cache_dir or _default_cache_dir()) / f"{source.stem}-{key}.so"
    if not path.exists():
        error = _build(compiler, source, path)
        if error is not None:
            return None, error
    try:
        library = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"the built library {path} does not load: {exc}"
    return library, f"built from {source.name} at {path}"


def _build(compiler: str, source: Path, path: Path) -> str | None:
    """Compile ``source`` to ``path`` (atomically); the error text, or None."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as work:
            partial = Path(work) / path.name
            result = subprocess.run(
                [compiler, *FLAGS, str(source), "-o", str(partial)],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if result.returncode != 0:
                return f"{compiler} could not build {source.name}: {result.stderr.strip()[-500:]}"
            os.replace(partial, path)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"building {source.name} failed: {exc}"
    return None


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "loramux" / "native"


def _cpu() -> bytes:
    """What -march=native depends on: the CPU's model and flags (Linux), else the machine."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine().encode()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines))).encode()
