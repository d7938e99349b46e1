"""How a request names an adapter it may call, and which version that means.

- ``name``: the caller's adapter's newest ready version (or the one its alias names);
- ``name@3``: its version 3;
- ``name@sha256:1f2e3d4c``: its version whose weights' SHA-256 starts with those hex
  digits (at least ``MIN_DIGEST_PREFIX``; the version's ``sha256`` in the adapter API);
- ``owner/name`` and the same forms after it: tenant ``owner``'s adapter, shared with the
  caller (``adapter_grants``).

Adapter names never hold ``/`` or ``@`` (``adapters.NAME_PATTERN``), so the split is
unambiguous: the owner is what comes before the last ``/`` (a tenant's name may hold either).
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
FORMS = (
    "`name`, `name@<version number>` or `name@sha256:<at least 8 hex digits>`, each "
    "optionally after `<owner>/`"
)


def _unread(model: str) -> Invalid:
    return Invalid(
        f"The model {model!r} names an adapter in a form this server does not read: use {FORMS}.",
        code="invalid_model",
    )


@dataclass(frozen=True)
class AdapterRef:
    name: str
    number: int | None = None  # name@3
    digest_prefix: str | None = None  # name@sha256:<prefix>, lower-case hex
    owner: str | None = None  # owner/name: another tenant's, by that tenant's name

    @classmethod
    def parse(cls, model: str) -> AdapterRef:
        """``model`` as an adapter reference; a 400 naming the forms if the part after
        ``@`` is neither a version number nor a digest prefix, or the owner is empty."""
        owner, slash, rest = model.rpartition("/")
        if slash and not owner:  # "/name": an empty owner
            raise _unread(model)
        name, at, version = rest.partition("@")
        owned = {"owner": owner} if slash else {}
        if not at:
            return cls(name, **owned)
        if number := _NUMBER.fullmatch(version):
            return cls(name, number=int(number.group()), **owned)
        if digest := _DIGEST.fullmatch(version.lower()):
            return cls(name, digest_prefix=digest.group(1), **owned)
        raise _unread(model)

    @property
    def is_bare(self) -> bool:
        """Only the name: the version its alias names, else its newest ready one."""
        return self.number is None and self.digest_prefix is None

    def own(self) -> AdapterRef:
        """The same reference without its owner (the caller naming itself as owner)."""
        return AdapterRef(self.name, self.number, self.digest_prefix)

    def __str__(self) -> str:
        owned = self.name if self.owner is None else f"{self.owner}/{self.name}"
        if self.number is not None:
            return f"{owned}@{self.number}"
        if self.digest_prefix is not None:
            return f"{owned}@sha256:{self.digest_prefix}"
        return owned
