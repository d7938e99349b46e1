"""The soak's ledger: every response the clients saw and every churn act, as the load's
threads record them.

Part of the soak (``soak.py``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass
class Outcome:
    """One request as the client saw it."""

    client: int
    kind: str
    tenant: str
    target: str  # base, stable, fresh or churned
    model: str
    picked_s: float  # seconds from the load's start
    finished_s: float = 0.0
    status: str = ""  # the HTTP status, "transport" or "stream_error"
    error: str | None = None  # the error's code or text
    request_id: str | None = None
    usage: dict | None = None  # as returned: prompt, cached prompt, completion tokens, cost
    delivered: int | None = None  # a dropped stream: the tokens the client received


@dataclass
class ChurnEvent:
    action: str  # upload, version or delete
    tenant: str
    name: str
    started_s: float
    finished_s: float = 0.0
    status: str = ""
    version: int | None = None
    adapter: str | None = None  # the pool adapter's shape


class Ledger:
    def __init__(self, t0: float):
        self.t0 = t0
        self.outcomes: list[Outcome] = []
        self.events: list[ChurnEvent] = []
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def record(self, item: Outcome | ChurnEvent) -> None:
        with self._lock:
            (self.outcomes if isinstance(item, Outcome) else self.events).append(item)
