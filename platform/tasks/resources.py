"""What the tasks use, built from settings on first use in each worker process.

Tasks need sessions and the object store, not the engine or the HTTP app. They are built
lazily (never at import, nor when the Celery app is made) and rebuilt in a process forked
after they were built, so a prefork child never shares its parent's database connections.
The schema is the platform's to migrate (``loramux serve`` upgrades it at start).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from loramux.platform.db.session import create_engine_for, session_factory
from loramux.platform.services.upload_workspace import WorkerScratch
from loramux.platform.settings import Settings
from loramux.platform.store import ObjectStore, build_store


@dataclass(frozen=True)
class TaskContext:
    sessions: sessionmaker[Session]  # metadata database
    store: ObjectStore  # where exports are written
    scratch: WorkerScratch  # where validations read adapters to


class TaskResources:
    """A per-process, lazily built :class:`TaskContext` for one ``Settings``."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._context: TaskContext | None = None
        self._pid: int | None = None

    def get(self) -> TaskContext:
        with self._lock:
            if self._context is None or self._pid != os.getpid():
                engine = create_engine_for(self._settings.resolved_database_url)
                scratch = WorkerScratch.in_data_dir(self._settings.data_dir)
                scratch.remove_dead()  # what killed workers of this host left
                self._context = TaskContext(
                    sessions=session_factory(engine),
                    store=build_store(self._settings),
                    scratch=scratch,
                )
                self._pid = os.getpid()
            return self._context
