"""Entry module for Celery's command line, and the one module that builds at import.

``celery -A loramux.platform.tasks.worker worker`` (or ``beat``) imports this module and
needs an app at module level, so ``app`` is made here from ``Settings()`` (the ``LORAMUX_``
environment). Nothing in loramux imports it: everything else calls ``make_celery``.
"""

from __future__ import annotations

from loramux.platform.settings import Settings
from loramux.platform.tasks.celery_app import make_celery

app = make_celery(Settings())
