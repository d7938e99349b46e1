"""The operator's bearer token: from LORAMUX_ADMIN_TOKEN, or created once and kept.

On the embedded default the first start creates a random token, writes it to
``<data_dir>/admin_token`` (mode 0600) and reports that it was created so the CLI
prints it once; later starts read it back silently.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from loramux.platform.settings import Settings

TOKEN_FILE = "admin_token"
TOKEN_PREFIX = "lmx-admin-"


@dataclass(frozen=True)
class AdminToken:
    value: str
    created: bool  # True only on the start that made it (print it then)


def load_or_create_admin_token(settings: Settings) -> AdminToken:
    if settings.admin_token is not None:
        return AdminToken(settings.admin_token.get_secret_value(), created=False)
    path = settings.data_dir / TOKEN_FILE
    if path.is_file():
        return AdminToken(path.read_text().strip(), created=False)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    _write_private(path, token + "\n")
    return AdminToken(token, created=True)


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # a new data dir is private
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)
