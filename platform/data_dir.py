"""The data directory is private to the user loramux runs as.

It holds what no other local user may read: the SQLite database (tenants, API key hashes,
usage), the local adapter store (tenants' adapters), converted models, adapter caches and
the admin token. :func:`make_data_dir_private` runs first thing at start:

- it sets the process umask to ``0o077``, so whatever loramux writes from then on (the
  database and its journal, store objects, converted models, caches, temporary folders)
  is readable by its owner only;
- it creates the directory ``0700``, or, when an existing one is open to others (made by
  an older loramux, or by hand), tightens it and everything in it, and says so in the log.
  Once the directory itself is ``0700`` nothing below it is reachable by others, so this
  walk happens once, not at every start.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

PRIVATE_UMASK = 0o077
_OTHERS = 0o077  # group and other permission bits


def _tighten(path: Path) -> None:
    os.chmod(path, stat.S_IMODE(path.lstat().st_mode) & ~_OTHERS)


def _tighten_tree(root: Path) -> tuple[int, list[str]]:
    """Owner-only modes for ``root`` and everything in it; (entries changed, failures)."""
    changed, failed = 0, []
    for folder, dirs, files in os.walk(root):  # never follows links
        for name in [*dirs, *files]:
            path = Path(folder) / name
            if path.is_symlink():
                continue  # chmod would change the link's target, which may be anywhere
            try:
                if stat.S_IMODE(path.lstat().st_mode) & _OTHERS:
                    _tighten(path)
                    changed += 1
            except OSError as exc:
                failed.append(f"{path}: {exc.strerror}")
    _tighten(root)  # last: a failure above must not leave the walk half-way unreachable
    return changed + 1, failed


def make_data_dir_private(data_dir: Path, *, log: Callable[[str], None] = print) -> None:
    """Set the owner-only umask, and create or tighten ``data_dir`` (see the module)."""
    os.umask(PRIVATE_UMASK)
    if not data_dir.exists():
        data_dir.mkdir(mode=0o700, parents=True)
        return
    mode = stat.S_IMODE(data_dir.stat().st_mode)
    if not mode & _OTHERS:
        return
    try:
        changed, failed = _tighten_tree(data_dir)
    except OSError as exc:  # not ours to change (e.g. a volume root owned by another user)
        log(
            f"Warning: data directory {data_dir} is readable by other users (mode {mode:04o}) "
            f"and could not be tightened ({exc.strerror}): make it mode 0700, owned by the "
            "user loramux runs as."
        )
        return
    log(
        f"Data directory {data_dir} was open to other users (mode {mode:04o}): made it and "
        f"{changed - 1} entries in it readable by their owner only."
    )
    if failed:
        log(f"Warning: could not tighten {len(failed)} entries: {'; '.join(failed[:5])}")
