"""The soak's threads (clients, churn, sampler): a crash of one is kept and raised again.

Part of the soak (``soak.py``).
"""

from __future__ import annotations

import threading


class Worker(threading.Thread):
    """A thread of the soak whose crash (a bug of the soak, not of the server) is kept and
    raised again by ``join_all``."""

    def __init__(self, name: str):
        super().__init__(name=name, daemon=True)
        self.crash: BaseException | None = None

    def run(self) -> None:
        try:
            self.work()
        except BaseException as exc:
            self.crash = exc

    def work(self) -> None:
        raise NotImplementedError


def join_all(workers: list[Worker]) -> None:
    for worker in workers:
        worker.join()
    for worker in workers:
        if worker.crash is not None:
            raise RuntimeError(f"the soak's {worker.name} thread crashed") from worker.crash
