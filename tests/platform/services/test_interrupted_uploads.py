"""Uploads cut off by a crash (stuck in uploading/validating) are removed at the next start."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select

from loramux.platform.db.models import Adapter, AdapterVersion
from loramux.platform.db.types import utc_now
from loramux.platform.services.adapters import discard_interrupted_uploads
from tests.platform.db.factories import add_adapter, add_adapter_version, add_tenant


def test_stale_unfinished_versions_are_removed_and_fresh_ones_kept(make_session):
    long_ago = utc_now() - timedelta(hours=3)
    with make_session.begin() as session:
        tenant = add_tenant(session)
        # An adapter whose only version was cut off: both rows go.
        orphan = add_adapter(session, tenant, name="orphan")
        add_adapter_version(session, orphan, 1, status="validating", updated_at=long_ago)
        # A ready v1 and a cut-off v2: only v2 goes.
        kept = add_adapter(session, tenant, name="kept")
        add_adapter_version(session, kept, 1, status="ready", updated_at=long_ago)
        add_adapter_version(session, kept, 2, status="uploading", updated_at=long_ago)
        # An upload in progress right now: untouched.
        live = add_adapter(session, tenant, name="live")
        add_adapter_version(session, live, 1, status="validating")

    assert discard_interrupted_uploads(make_session) == 2

    with make_session() as session:
        names = set(session.scalars(select(Adapter.name)))
        assert names == {"kept", "live"}
        versions = {
            (adapter, version, status)
            for adapter, version, status in session.execute(
                select(Adapter.name, AdapterVersion.version, AdapterVersion.status).join(
                    AdapterVersion.adapter
                )
            )
        }
        assert versions == {("kept", 1, "ready"), ("live", 1, "validating")}
    assert discard_interrupted_uploads(make_session) == 0


def test_nothing_to_do_on_an_empty_database(make_session):
    assert discard_interrupted_uploads(make_session) == 0
    with make_session() as session:
        assert session.scalar(select(func.count()).select_from(AdapterVersion)) == 0
