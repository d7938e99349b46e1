"""How a request names one of its tenant's adapters, and which version that means.

- ``name``: the adapter's newest ready version;
- ``name@3``: its version 3;
- ``name@sha256:1f2e3d4c``: its version whose weights' SHA-256 starts with those hex
  digits (at least ``MIN_DIGEST_PREFIX``; the version's ``sha256`` in the adapter API).

Adapter names never hold ``@`` (``adapters.NAME_PATTERN``), so the split is unambiguous.
The version a request reaches is the one its usage record and the engine's cache carry
(the engine knows each version by its own id, so two versions never share cached KV).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from loramux.platform.errors import Invalid

MIN_DIGEST_PREFIX = 8
_NUMBER = re.compile(r"[1-9][0-9]{0,8}")
_DIGEST = re.compile(rf"sha256:([0-9a-f]{{{MIN_DIGEST_PREFIX},64}})")
FORMS = "`name`, `name@<version number>` or `name@sha256:<at least 8 hex digits>`"


@dataclass(frozen=True)
class AdapterRef:
    name: str
    number: int | None = None  # name@3
    digest_prefix: str | None = None  # name@sha256:<prefix>, lower-case hex

    @classmethod
    def parse(cls, model: str) -> AdapterRef:
        """``model`` as an adapter reference; a 400 naming the forms if the part after
        ``@`` is neither a version number nor a digest prefix."""
        name, at, version = model.partition("@")
        if not at:
            return cls(name)
        if number := _NUMBER.fullmatch(version):
            return cls(name, number=int(number.group()))
        if digest := _DIGEST.fullmatch(version.lower()):
            return cls(name, digest_prefix=digest.group(1))
        raise Invalid(
            f"The model {model!r} names a version in a form this server does not read: "
            f"use {FORMS}.",
            code="invalid_model",
        )

    @property
    def is_bare(self) -> bool:
        """Only the name: the version its alias names, else its newest ready one."""
        return self.number is None and self.digest_prefix is None

    def __str__(self) -> str:
        if self.number is not None:
            return f"{self.name}@{self.number}"
        if self.digest_prefix is not None:
            return f"{self.name}@sha256:{self.digest_prefix}"
        return self.name
