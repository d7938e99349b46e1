"""The soak's tenants and adapters: three tenants with keys, the pool uploads draw from, the
stable adapters, and the catalog of live names the churn writes and the clients read."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loramux.benchmarks.common.adapters import ALL_SEVEN, QKVO, AdapterSpec, prepare_adapters
from loramux.benchmarks.common.bench_server import ADAPTER_FILES
from loramux.benchmarks.soak_server import REQUEST_TIMEOUT_S, Server, expect

QV = ("q_proj", "v_proj")
# The adapters uploads draw from: small ranks over three target sets.
POOL_SHAPES = ((4, QV), (8, QKVO), (16, QKVO), (4, ALL_SEVEN), (8, ALL_SEVEN), (16, QV))

# Three tenants: priorities, weights and prices differ; silver has a monthly budget and
# rate limits far above what the soak sends, so every request takes and releases a budget
# hold and limiter reservations without ever being refused.
TENANTS = (
    {
        "name": "gold",
        "priority": 7,
        "weight": 2.0,
        "input_price_per_mtok": 1.5,
        "cached_input_price_per_mtok": 0.5,
        "output_price_per_mtok": 6.0,
    },
    {
        "name": "silver",
        "priority": 5,
        "weight": 1.0,
        "input_price_per_mtok": 2.0,
        "output_price_per_mtok": 3.0,
        "monthly_budget_usd": 1000.0,
        "requests_per_minute": 100_000,
        "tokens_per_minute": 10_000_000,
    },
    {
        "name": "bronze",
        "priority": 5,
        "weight": 0.5,
        "input_price_per_mtok": 0.25,
        "output_price_per_mtok": 11.0,
    },
)
STABLE_ADAPTERS = 2  # per tenant: uploaded before the load, never deleted (new versions at times)


@dataclass
class Tenant:
    name: str
    id: str
    key: str
    stable: list[str] = field(default_factory=list)  # never deleted; new versions at times
    churned: list[str] = field(default_factory=list)  # live churned names, oldest first
    fresh: str | None = None  # the churned name uploaded (or re-versioned) last (while live)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


def prepare_pool(model_dir: Path, cache_dir: Path) -> list[AdapterSpec]:
    """One adapter per ``POOL_SHAPES`` entry for ``model_dir``, written once into the cache."""
    return prepare_adapters(cache_dir, model_dir, POOL_SHAPES, len(POOL_SHAPES), seed=7000)


def upload(client: httpx.Client, tenant: Tenant, name: str, adapter: AdapterSpec):
    files = [("files", (f, (adapter.path / f).read_bytes())) for f in ADAPTER_FILES]
    return client.post("/v1/adapters", data={"name": name}, files=files, headers=tenant.headers)


def setup_tenants(server: Server, pool: list[AdapterSpec]) -> Catalog:
    """The tenants, each with an API key and its stable adapters uploaded and ready."""
    tenants = []
    with httpx.Client(
        base_url=server.url, headers=server.admin, timeout=REQUEST_TIMEOUT_S
    ) as client:
        for t, body in enumerate(TENANTS):
            made = expect(client.post("/admin/tenants", json=body), 201, f"tenant {body['name']}")
            key = expect(client.post(f"/admin/tenants/{made['id']}/api-keys"), 201, "API key")
            tenant = Tenant(body["name"], made["id"], key["key"])
            for k in range(STABLE_ADAPTERS):
                name = f"stable-{k}"
                adapter = pool[(t * STABLE_ADAPTERS + k) % len(pool)]
                done = expect(upload(client, tenant, name, adapter), 201, f"uploading {name}")
                if done.get("status") != "ready":
                    raise RuntimeError(f"{tenant.name}/{name} is {done.get('status')!r}")
                tenant.stable.append(name)
            tenants.append(tenant)
        models = expect(client.get("/v1/models"), 200, "listing models")["data"]
    return Catalog(tenants, models[0]["id"])  # an operator sees the base model only


class Catalog:
    """The tenants' live adapter names, shared by the churn (writes) and the clients (reads).

    The churn takes a name out before deleting it, so a client can only pick a deleted
    adapter in the moment between its pick and the delete: such a 404 is expected."""

    def __init__(self, tenants: list[Tenant], base_model: str):
        self.tenants = tenants
        self.base_model = base_model
        self._lock = threading.Lock()

    def pick(self, rng: random.Random, tenant: Tenant, target: str) -> tuple[str, str]:
        """(what was picked: base, stable, fresh or churned; the model name)."""
        with self._lock:
            if target == "churned" and tenant.churned:
                if tenant.fresh in tenant.churned and rng.random() < 0.5:
                    return "fresh", tenant.fresh
                return "churned", rng.choice(tenant.churned)
            if target == "base":
                return "base", self.base_model
            return "stable", rng.choice(tenant.stable)

    def added(self, tenant: Tenant, name: str) -> None:
        """``name`` has a new ready version (a stable name stays stable)."""
        if name in tenant.stable:
            return
        with self._lock:
            if name not in tenant.churned:
                tenant.churned.append(name)
            tenant.fresh = name

    def removed(self, tenant: Tenant, name: str) -> None:
        with self._lock:
            tenant.churned.remove(name)
