"""The soak's adapter churn: every few seconds one tenant in turn uploads a new adapter,
uploads a new version of one, or deletes its oldest churned one.

Part of the soak (``soak.py``).
"""

from __future__ import annotations

import random
from collections import Counter

import httpx

from loramux.benchmarks.soak_ledger import ChurnEvent, Ledger
from loramux.benchmarks.soak_server import REQUEST_TIMEOUT_S, Server
from loramux.benchmarks.soak_tenants import Catalog, Tenant, upload
from loramux.benchmarks.soak_worker import Worker

MAX_CHURNED = 4  # live churned adapters per tenant; past this the churn deletes the oldest
CHURN_NAMES = 6  # churned names cycle through churn-0..5: a deleted name is uploaded again


class Churner(Worker):
    """Every ``interval`` seconds the next tenant in turn uploads a new adapter, uploads a
    new version of one, or deletes its oldest churned one."""

    def __init__(self, server: Server, catalog: Catalog, ledger: Ledger, pool, args, stop):
        super().__init__("soak-churn")
        self.url = server.url
        self.catalog = catalog
        self.ledger = ledger
        self.pool = pool
        self.stop = stop
        self.interval = args.churn_interval
        self.rng = random.Random(args.seed * 1_000 + 999)
        self.acts = 0
        self.next_name = Counter()  # tenant -> index of its next churned name

    def work(self) -> None:
        with httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_S) as client:
            while not self.stop.wait(self.interval):
                tenant = self.catalog.tenants[self.acts % len(self.catalog.tenants)]
                action = self.choose(tenant)
                self.ledger.record(self.act(client, tenant, action))
                self.acts += 1

    def choose(self, tenant: Tenant) -> str:
        live = self.catalog.churned(tenant)
        if len(live) >= MAX_CHURNED:
            return "delete"
        if not live:
            return "upload"
        return ("upload", "version", "delete")[(self.acts // len(self.catalog.tenants)) % 3]

    def act(self, client: httpx.Client, tenant: Tenant, action: str) -> ChurnEvent:
        live = self.catalog.churned(tenant)
        if action == "upload":
            name = self.new_name(tenant, live)
        elif action == "version":  # of a stable adapter or a churned one, half and half
            name = self.rng.choice(tenant.stable if self.rng.random() < 0.5 else live)
        else:  # a delete takes the oldest churned one
            name = live[0]
        event = ChurnEvent(action, tenant.name, name, self.ledger.now())
        try:
            if action == "delete":
                self.catalog.removed(tenant, name)  # no client picks it from now on
                response = client.delete(f"/v1/adapters/{name}", headers=tenant.headers)
            else:
                adapter = self.rng.choice(self.pool)
                event.adapter = adapter.label
                response = upload(client, tenant, name, adapter)
                if response.status_code == 201 and response.json().get("status") == "ready":
                    event.version = response.json().get("version")
                    self.catalog.added(tenant, name)
            event.status = str(response.status_code)
        except httpx.HTTPError as exc:
            event.status = f"transport: {type(exc).__name__}: {exc}"[:300]
        event.finished_s = self.ledger.now()
        return event

    def new_name(self, tenant: Tenant, live: list[str]) -> str:
        while True:  # the next of churn-0..CHURN_NAMES-1 not live (MAX_CHURNED < CHURN_NAMES)
            k = self.next_name[tenant.name] % CHURN_NAMES
            self.next_name[tenant.name] += 1
            if f"churn-{k}" not in live:
                return f"churn-{k}"
