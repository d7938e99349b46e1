"""The Celery app: JSON messages only, billing exports and usage roll-ups, eager without a broker.

``make_celery(settings)`` builds an app and registers its tasks on it; nothing happens at
import. With ``celery_broker_url`` unset (the embedded default) tasks run eagerly in the
caller's process; with a broker, ``celery -A loramux.platform.tasks.worker worker`` runs
them and ``... beat`` schedules the daily export and the usage roll-ups.

Tasks (called by name; arguments and results are JSON). Both scheduled ones work on *closed*
UTC days (``loramux.platform.services.rollups``: a day closes ``ROLLUP_GRACE`` after its
end) and catch up from where the last run stopped, so a task that waits in the queue, runs
twice or misses a day still covers each day exactly once, whatever day it runs on:

* ``loramux.validate_adapter(version_id, target)``: validate a queued upload's stored files
  against ``target`` (a ``ValidationTarget`` as JSON: the platform's base model and limits)
  and mark the version ready or failed; see ``loramux.platform.services.adapter_upload``.
  The platform sends it with an expiry equal to the queue's lease on the version (one hour):
  a task no worker starts by then is dropped, and the platform's sweep fails the version. A
  worker takes the version over under a lease of its own, renewed while it works; if the
  worker dies, the task is redelivered (at once for a killed prefork child) and the next
  worker takes over, or, once that lease runs out, the sweep fails the version
  (``loramux.platform.services.upload_cleanup``).

* ``loramux.export_daily_billing(day=None)``: export, grouped by
  ``billing_export_group_by``, every closed day not exported final yet
  (``export_closed_days``), or only ``day`` (``"YYYY-MM-DD"``; ``ValueError`` if it is not
  closed). Returns the grouping and, per day exported, the export's id, store key
  (``billing/<day>.by-<grouping>[.v<n>].csv``), version, sha256, size and row count. Beat
  sends it every day at 00:10 UTC with no argument.

* ``loramux.rollup_usage(day=None)``: roll up every closed day not rolled up yet
  (``rollup_closed_days``), or roll ``day`` up again (``ValueError`` if it is not closed),
  e.g. after a backfill. Returns the days rolled up. Beat sends it every
  ``usage_rollup_interval_s`` seconds with no argument.
"""

from __future__ import annotations

from datetime import date, timedelta
from typing import Any

from celery import Celery
from celery.schedules import crontab

from loramux.platform.db.models import BillingExport
from loramux.platform.db.types import utc_now
from loramux.platform.services.adapter_upload import ValidationTarget, validate_stored_version
from loramux.platform.services.billing_exports import DayRange, export_period
from loramux.platform.services.rollups import (
    is_closed,
    rollup_closed_days,
    rollup_day,
)
from loramux.platform.settings import Settings
from loramux.platform.store import StoreUnavailable
from loramux.platform.tasks.billing import export_closed_days
from loramux.platform.tasks.resources import TaskResources

EXPORT_DAILY_BILLING = "loramux.export_daily_billing"
ROLLUP_USAGE = "loramux.rollup_usage"
VALIDATE_ADAPTER = "loramux.validate_adapter"
DAILY_EXPORT_AT = crontab(hour=0, minute=10)  # in the app's time zone, UTC
EAGER_BROKER_URL = "memory://"  # never used: eager tasks do not reach a broker


def closed_day(day: str) -> date:
    """``day`` (``"YYYY-MM-DD"``) as a date; ``ValueError`` unless it is closed by now."""
    parsed = date.fromisoformat(day)
    if not is_closed(parsed, utc_now()):
        raise ValueError(f"{parsed.isoformat()} is not a closed UTC day yet")
    return parsed


def export_summary(export: BillingExport) -> dict[str, Any]:
    """What the export task reports about one export."""
    return {
        "day": export.period_start.date().isoformat(),
        "id": export.id,
        "store_key": export.store_key,
        "version": export.version,
        "sha256": export.sha256,
        "size_bytes": export.size_bytes,
        "rows": export.rows,
    }


def register_tasks(app: Celery, settings: Settings) -> None:
    """Define the tasks on ``app``; each builds its database and store on first use."""
    resources = TaskResources(settings)

    # shared=False: Celery would otherwise add the task to every app made in this process.
    @app.task(name=EXPORT_DAILY_BILLING, shared=False)
    def export_daily_billing(day: str | None = None) -> dict[str, Any]:
        context = resources.get()
        group_by = settings.billing_export_group_by
        now = utc_now()
        if day is None:
            exports = export_closed_days(
                context.sessions, context.store, now=now, group_by=group_by
            )
        else:
            closed = closed_day(day)
            outcome = export_period(
                context.sessions,
                context.store,
                DayRange(closed, closed),
                group_by=group_by,
                now=now,
            )
            exports = [outcome.export]
        return {"group_by": group_by, "exports": [export_summary(e) for e in exports]}

    @app.task(name=ROLLUP_USAGE, shared=False)
    def rollup_usage(day: str | None = None) -> dict[str, list[str]]:
        context = resources.get()
        if day is None:
            days = rollup_closed_days(context.sessions, now=utc_now())
        else:
            days = [closed_day(day)]
            with context.sessions.begin() as session:
                rollup_day(session, days[0])
        return {"days": [rolled.isoformat() for rolled in days]}

    # A store outage is retried (with backoff); a bad adapter is a result, not an error.
    @app.task(
        name=VALIDATE_ADAPTER,
        shared=False,
        autoretry_for=(StoreUnavailable,),
        retry_backoff=True,
        max_retries=5,
    )
    def validate_adapter(version_id: str, target: dict[str, Any]) -> dict[str, str]:
        context = resources.get()
        status = validate_stored_version(
            context.sessions,
            context.store,
            version_id,
            ValidationTarget.from_json(target),
            scratch_dir=context.scratch.folder(),
        )
        return {"version_id": version_id, "status": status}


def make_celery(settings: Settings) -> Celery:
    """A Celery app for ``settings`` with the tasks registered (see the module)."""
    eager = settings.celery_broker_url is None
    app = Celery(
        "loramux", broker=settings.celery_broker_url or EAGER_BROKER_URL, set_as_current=False
    )
    app.conf.update(
        # JSON only: a worker never unpickles what the broker hands it.
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_ignore_result=True,  # no result backend: tasks record their own outcome
        task_always_eager=eager,
        task_eager_propagates=True,
        # Tasks are idempotent: redeliver one whose worker died rather than lose it.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        broker_connection_retry_on_startup=True,
        timezone="UTC",
        enable_utc=True,
        beat_schedule={
            "export-daily-billing": {"task": EXPORT_DAILY_BILLING, "schedule": DAILY_EXPORT_AT},
            "rollup-usage": {
                "task": ROLLUP_USAGE,
                "schedule": timedelta(seconds=settings.usage_rollup_interval_s),
            },
        },
    )
    register_tasks(app, settings)
    return app
