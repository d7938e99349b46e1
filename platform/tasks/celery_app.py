"""The Celery app: JSON messages only, the daily billing export, in-process without a broker.

``make_celery(settings)`` builds an app and registers its tasks on it; nothing happens at
import. With ``celery_broker_url`` unset (the embedded default) tasks run eagerly in the
caller's process; with a broker, ``celery -A loramux.platform.tasks.worker worker`` runs
them and ``... beat`` schedules the daily export.

Tasks (called by name; arguments and results are JSON):

* ``loramux.validate_adapter(version_id, target)``: validate a queued upload's stored files
  against ``target`` (a ``ValidationTarget`` as JSON: the platform's base model and limits)
  and mark the version ready or failed; see ``loramux.platform.services.adapter_upload``.

* ``loramux.export_daily_billing(day=None)``: export one UTC day (``"YYYY-MM-DD"``; default:
  the UTC day before the moment the task runs) grouped by ``billing_export_group_by``;
  returns the export's id, store key, sha256, size and row count. Beat sends it every day
  at 00:10 UTC with no argument, so a task that waits in the queue past the next midnight
  exports the wrong day: run it again with ``day`` set (it is idempotent).
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from celery import Celery
from celery.schedules import crontab

from loramux.platform.db.types import utc_now
from loramux.platform.services.adapter_upload import ValidationTarget, validate_stored_version
from loramux.platform.settings import Settings
from loramux.platform.store import StoreUnavailable
from loramux.platform.tasks.billing import export_billing
from loramux.platform.tasks.resources import TaskResources

EXPORT_DAILY_BILLING = "loramux.export_daily_billing"
VALIDATE_ADAPTER = "loramux.validate_adapter"
DAILY_EXPORT_AT = crontab(hour=0, minute=10)  # in the app's time zone, UTC
EAGER_BROKER_URL = "memory://"  # never used: eager tasks do not reach a broker


def previous_utc_day(now: datetime) -> date:
    """The UTC calendar day before the one ``now`` (aware) falls on."""
    return now.astimezone(UTC).date() - timedelta(days=1)


def utc_day_bounds(day: date) -> tuple[datetime, datetime]:
    """``[00:00, next 00:00)`` of ``day`` in UTC."""
    start = datetime.combine(day, time(), tzinfo=UTC)
    return start, start + timedelta(days=1)


def register_tasks(app: Celery, settings: Settings) -> None:
    """Define the tasks on ``app``; each builds its database and store on first use."""
    resources = TaskResources(settings)

    # shared=False: Celery would otherwise add the task to every app made in this process.
    @app.task(name=EXPORT_DAILY_BILLING, shared=False)
    def export_daily_billing(day: str | None = None) -> dict[str, Any]:
        export_day = date.fromisoformat(day) if day else previous_utc_day(utc_now())
        start, end = utc_day_bounds(export_day)
        context = resources.get()
        export = export_billing(
            context.sessions,
            context.store,
            period_start=start,
            period_end=end,
            group_by=settings.billing_export_group_by,
        )
        return {
            "id": export.id,
            "day": export_day.isoformat(),
            "group_by": export.group_by,
            "store_key": export.store_key,
            "sha256": export.sha256,
            "size_bytes": export.size_bytes,
            "rows": export.rows,
        }

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
            context.sessions, context.store, version_id, ValidationTarget.from_json(target)
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
            "export-daily-billing": {"task": EXPORT_DAILY_BILLING, "schedule": DAILY_EXPORT_AT}
        },
    )
    register_tasks(app, settings)
    return app
