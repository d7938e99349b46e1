"""Compiled grammars kept for reuse, bounded in bytes for the engine and for each tenant.

Entries are keyed by (tenant, spec key): a tenant's hit is always on a grammar it compiled
itself (as the prefix cache salts its hashes by tenant, no tenant learns from a fast answer
what another asked for), and every entry's bytes are charged to one tenant.

Keeping tenant t's new grammar of b bytes:

1. b over the tenant budget: not kept (``not_kept``). The requests that asked for it still
   use it; its memory goes when they end.
2. t's own least recently used entries go until t's bytes + b fit the tenant budget.
3. The least recently used entries of any tenant go until the total + b fits the engine
   budget.

So a tenant sending new schemas evicts its own grammars first, and others' only while its
own holding grows, which stops at the tenant budget: it can displace no more of theirs than
that. Not thread-safe: its owner (the compiler) calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Generic, TypeVar

V = TypeVar("V")
Tenant = str | None

DEFAULT_BUDGET_BYTES = 256 << 20
TENANT_SHARE = 4  # without a tenant budget: a quarter of the engine's


@dataclass(frozen=True)
class GrammarCacheStats:
    """The compiled-grammar cache now, and its counts since the engine started."""

    entries: int = 0
    bytes: int = 0  # held by the entries (grammar_bytes.py: how they are measured)
    budget_bytes: int = 0  # the most the engine keeps
    tenant_budget_bytes: int = 0  # the most one tenant's entries keep
    tenants: int = 0  # tenants with an entry
    largest_tenant_bytes: int = 0  # the bytes of the tenant holding most
    hits: int = 0  # compiles answered from the cache (or by a compile under way)
    misses: int = 0  # compiles started (failed ones included)
    evictions: int = 0  # entries evicted, for either budget
    tenant_evictions: int = 0  # of those, evicted to fit their own tenant's budget
    evicted_bytes: int = 0
    not_kept: int = 0  # grammars larger than the tenant budget, used but not kept


@dataclass
class _Holding:
    """One tenant's entries: spec key -> bytes, least recently used first."""

    keys: OrderedDict[str, int] = field(default_factory=OrderedDict)
    bytes: int = 0


class GrammarCache(Generic[V]):
    """Least recently used first out, within ``budget_bytes`` in all and
    ``tenant_budget_bytes`` per tenant (None: a quarter of the budget)."""

    def __init__(
        self, budget_bytes: int = DEFAULT_BUDGET_BYTES, tenant_budget_bytes: int | None = None
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        if tenant_budget_bytes is None:
            tenant_budget_bytes = budget_bytes // TENANT_SHARE
        if not 0 < tenant_budget_bytes <= budget_bytes:
            raise ValueError(
                f"tenant_budget_bytes must be in (0, budget_bytes={budget_bytes}], "
                f"got {tenant_budget_bytes}"
            )
        self.budget_bytes = budget_bytes
        self.tenant_budget_bytes = tenant_budget_bytes
        self._entries: OrderedDict[tuple[Tenant, str], V] = OrderedDict()  # LRU first
        self._holdings: dict[Tenant, _Holding] = {}
        self._bytes = 0
        self._evictions = 0
        self._tenant_evictions = 0
        self._evicted_bytes = 0
        self._not_kept = 0

    def get(self, tenant: Tenant, key: str) -> V | None:
        """The tenant's entry for ``key`` (now its most recently used), or None."""
        value = self._entries.get((tenant, key))
        if value is not None:
            self._entries.move_to_end((tenant, key))
            self._holdings[tenant].keys.move_to_end(key)
        return value

    def put(self, tenant: Tenant, key: str, value: V, nbytes: int) -> bool:
        """Keep ``value`` (``nbytes``) for the tenant, evicting as the module says; False if
        it is larger than the tenant budget and was not kept."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if (tenant, key) in self._entries:
            self._remove(tenant, key)
        if nbytes > self.tenant_budget_bytes:
            self._not_kept += 1
            return False
        holding = self._holdings.setdefault(tenant, _Holding())
        while holding.bytes + nbytes > self.tenant_budget_bytes:
            self._evict(tenant, next(iter(holding.keys)))
            self._tenant_evictions += 1
        while self._bytes + nbytes > self.budget_bytes:
            self._evict(*next(iter(self._entries)))
        holding = self._holdings.setdefault(tenant, holding)  # evicting may have dropped it
        self._entries[(tenant, key)] = value
        holding.keys[key] = nbytes
        holding.bytes += nbytes
        self._bytes += nbytes
        return True

    def tenant_usage(self) -> dict[Tenant, tuple[int, int]]:
        """Per tenant with an entry: (bytes, entries)."""
        return {t: (h.bytes, len(h.keys)) for t, h in self._holdings.items()}

    def stats(self, *, hits: int = 0, misses: int = 0) -> GrammarCacheStats:
        return GrammarCacheStats(
            entries=len(self._entries),
            bytes=self._bytes,
            budget_bytes=self.budget_bytes,
            tenant_budget_bytes=self.tenant_budget_bytes,
            tenants=len(self._holdings),
            largest_tenant_bytes=max((h.bytes for h in self._holdings.values()), default=0),
            hits=hits,
            misses=misses,
            evictions=self._evictions,
            tenant_evictions=self._tenant_evictions,
            evicted_bytes=self._evicted_bytes,
            not_kept=self._not_kept,
        )

    def __contains__(self, item: tuple[Tenant, str]) -> bool:
        return item in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _evict(self, tenant: Tenant, key: str) -> None:
        self._evicted_bytes += self._remove(tenant, key)
        self._evictions += 1

    def _remove(self, tenant: Tenant, key: str) -> int:
        del self._entries[(tenant, key)]
        holding = self._holdings[tenant]
        nbytes = holding.keys.pop(key)
        holding.bytes -= nbytes
        self._bytes -= nbytes
        if not holding.keys:
            del self._holdings[tenant]
        return nbytes
