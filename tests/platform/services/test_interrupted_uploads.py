"""Uploads cut off by a crash (stuck in uploading/validating) are removed at the next start,
with the staged files no other version shares."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select

from loramux.platform.db.models import Adapter, AdapterVersion
from loramux.platform.db.types import utc_now
from loramux.platform.services.adapter_upload import discard_interrupted_uploads
from loramux.platform.store.local import LocalObjectStore
from tests.platform.db.factories import add_adapter, add_adapter_version, add_tenant


def test_stale_unfinished_versions_are_removed_and_fresh_ones_kept(make_session, tmp_path):
    store = LocalObjectStore(tmp_path / "store")
    staged = store.put_stream(b"staged weights nobody else has")
    shared = store.put_stream(b"a config a ready version uses too")
    long_ago = utc_now() - timedelta(hours=3)
    with make_session.begin() as session:
        tenant = add_tenant(session)
        # An adapter whose only version was cut off while queued: rows and its file go.
        orphan = add_adapter(session, tenant, name="orphan")
        add_adapter_version(
            session,
            orphan,
            1,
            status="validating",
            updated_at=long_ago,
            weights_store_key=staged.key,
            config_store_key=shared.key,
        )
        # A ready v1 and a cut-off v2: only v2 goes.
        kept = add_adapter(session, tenant, name="kept")
        add_adapter_version(
            session, kept, 1, status="ready", updated_at=long_ago, config_store_key=shared.key
        )
        add_adapter_version(session, kept, 2, status="uploading", updated_at=long_ago)
        # An upload in progress right now: untouched.
        live = add_adapter(session, tenant, name="live")
        add_adapter_version(session, live, 1, status="validating")

    assert discard_interrupted_uploads(make_session, store) == 2
    assert not store.exists(staged.key)
    assert store.exists(shared.key)  # still the ready version's

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
    assert discard_interrupted_uploads(make_session, store) == 0


def test_nothing_to_do_on_an_empty_database(make_session, tmp_path):
    assert discard_interrupted_uploads(make_session, LocalObjectStore(tmp_path)) == 0
    with make_session() as session:
        assert session.scalar(select(func.count()).select_from(AdapterVersion)) == 0
