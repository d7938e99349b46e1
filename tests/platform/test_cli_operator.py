"""The operator's CLI commands (``loramux usage``, ``billing``, ``engines``) run in-process
with ``main([...])`` against a real PostgreSQL, local store and Redis, configured through
``LORAMUX_*`` variables as ``loramux serve`` is; one run goes through the console script."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pytest
import redis
import redis.asyncio

from loramux.platform.cli import main
from loramux.platform.db.migrate import upgrade
from loramux.platform.db.session import create_engine_for, session_factory
from loramux.platform.engine_fleet.registry import EngineRecord, EngineRegistry
from loramux.platform.services.billing import to_csv, usage_report
from loramux.platform.services.rollups import utc_day_bounds
from tests.platform.db.factories import add_tenant, usage_record

REGISTRY_DB = 11  # a Redis database of its own: no other test's engines in the listing


def _today() -> date:
    return datetime.now(UTC).date()


def _days_ago(n: int) -> date:
    return _today() - timedelta(days=n)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def env(monkeypatch, tmp_path) -> dict[str, str]:
    """A clean LORAMUX_* environment with the data directory in tmp_path."""
    for name in list(os.environ):
        if name.startswith("LORAMUX_") and not name.startswith("LORAMUX_TEST_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("LORAMUX_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    return {"LORAMUX_DATA_DIR": str(tmp_path / "data")}


@pytest.fixture
def database(env, monkeypatch, postgres_database_url) -> Iterator:
    """A migrated PostgreSQL database the CLI finds through LORAMUX_DATABASE_URL; its sessions."""
    upgrade(postgres_database_url)
    monkeypatch.setenv("LORAMUX_DATABASE_URL", postgres_database_url)
    env["LORAMUX_DATABASE_URL"] = postgres_database_url
    engine = create_engine_for(postgres_database_url)
    try:
        yield session_factory(engine)
    finally:
        engine.dispose()


def _usage(sessions, *moments: datetime) -> None:
    with sessions.begin() as session:
        tenant = add_tenant(session)
        session.add_all(usage_record(tenant, created_at=moment) for moment in moments)


def _at(day: date, hour: int = 12) -> datetime:
    return utc_day_bounds(day)[0] + timedelta(hours=hour)


def _on_a_thread(work):
    """``work()``'s result, run on a thread of its own (no event loop running there)."""
    result: list = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(work())
        except BaseException as exc:  # re-raised on the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """``loramux <argv>`` in this process: (exit status, stdout, stderr).

    On a thread of its own, as a command starts with no event loop running: the browser
    tests' Playwright keeps one running on the test session's main thread."""

    def command() -> int | str | None:
        try:
            return main(list(argv))
        except SystemExit as exit_:  # argparse's own refusals
            return exit_.code

    status = _on_a_thread(command)
    out, err = capsys.readouterr()
    if isinstance(out, bytes):  # capsysbinary
        out, err = out.decode(), err.decode()
    return status, out, err


# --- usage rollup ----------------------------------------------------------------------------


def test_usage_rollup_rolls_closed_days_and_explains_today(capsys, database):
    _usage(database, _at(_days_ago(3)), _at(_days_ago(3), 20), datetime.now(UTC))

    status, out, err = run(capsys, "usage", "rollup")

    assert (status, err) == (0, "")
    assert "Rolled up" in out and _days_ago(3).isoformat() in out
    assert f"today is {_today().isoformat()} UTC" in out and "5 minutes" in out

    status, out, _ = run(capsys, "usage", "rollup", "--json")
    assert status == 0
    body = json.loads(out)
    assert body["rolled_up"] == [] and body["open_days"][-1] == _today().isoformat()

    status, out, err = run(capsys, "usage", "rollup", "--day", _today().isoformat())
    assert status == 2 and out == "" and "not closed yet" in err
    status, out, _ = run(capsys, "usage", "rollup", "--day", _days_ago(3).isoformat(), "--json")
    assert status == 0 and json.loads(out)["rolled_up"] == [_days_ago(3).isoformat()]


# --- billing export, list, download -----------------------------------------------------------


def test_billing_export_of_a_closed_day_then_again(capsys, database):
    day = _days_ago(4)
    _usage(database, _at(day, 1), _at(day, 13))

    status, out, err = run(capsys, "billing", "export", "--day", day.isoformat())

    assert (status, err) == (0, "")
    assert out.startswith(f"Exported {day.isoformat()} by request: version 1, final")
    assert f"billing/{day.isoformat()}.by-request.csv" in out and "rows     2" in out

    status, out, _ = run(capsys, "billing", "export", "--day", day.isoformat(), "--json")
    again = json.loads(out)
    assert status == 0 and not again["created"] and again["version"] == 1
    assert again["key"] == f"billing/{day.isoformat()}.by-request.csv"
    assert "Already exported" in again["note"]


def test_billing_export_of_a_range_and_of_today(capsys, database):
    _usage(database, _at(_days_ago(6)), _at(_days_ago(5)), datetime.now(UTC))
    first, last = _days_ago(6).isoformat(), _days_ago(5).isoformat()

    status, out, _ = run(
        capsys, "billing", "export", "--start", first, "--end", last, "--group-by", "day", "--json"
    )
    assert status == 0
    export = json.loads(out)
    assert export["key"] == f"billing/{first}_{last}.by-day.csv" and export["rows"] == 2

    status, out, _ = run(capsys, "billing", "export", "--day", _today().isoformat())
    assert status == 0 and "provisional" in out and "Provisional:" in out


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--start", "2025-01-01", "--end", "2025-03-01"], "at most 31"),
        (["--start", "2025-01-05", "--end", "2025-01-04"], "after it ends"),
        (["--day", "2999-01-01"], "in the future"),
    ],
)
def test_billing_export_refuses_impossible_periods_with_2(capsys, database, argv, words):
    status, out, err = run(capsys, "billing", "export", *argv)
    assert status == 2 and out == "" and words in err


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--start", "2025-01-01"],
        ["--day", "2025-01-01", "--start", "2025-01-01", "--end", "2025-01-02"],
        ["--day", "yesterday"],
        ["--day", "2025-02-30"],
        ["--day", "2025-01-01", "--group-by", "week"],
    ],
)
def test_billing_export_bad_arguments_are_2(capsys, env, argv):
    status, out, err = run(capsys, "billing", "export", *argv)
    assert status == 2 and out == "" and "usage: loramux billing export" in err


def test_billing_list_newest_first(capsys, database):
    _usage(database, _at(_days_ago(3)))
    assert run(capsys, "billing", "list")[1].startswith("No billing exports yet")
    ids = []
    for day in (_days_ago(5), _days_ago(3)):
        status, out, _ = run(capsys, "billing", "export", "--day", day.isoformat(), "--json")
        ids.append(json.loads(out)["id"])

    status, out, _ = run(capsys, "billing", "list")

    assert status == 0
    header, *lines = out.strip().splitlines()
    assert header.split()[:5] == ["ID", "PERIOD", "GROUP", "BY", "V"]
    assert [line.split()[0] for line in lines] == list(reversed(ids))
    assert "final" in lines[0] and f"billing/{_days_ago(3).isoformat()}" in lines[0]
    listed = json.loads(run(capsys, "billing", "list", "--json", "--limit", "1")[1])
    assert [e["id"] for e in listed] == [ids[1]]


def test_billing_download_writes_the_verified_csv(capsysbinary, database, tmp_path):
    capsys = capsysbinary
    day = _days_ago(3)
    _usage(database, _at(day, 2), _at(day, 22))
    export = json.loads(run(capsys, "billing", "export", "--day", day.isoformat(), "--json")[1])
    start, end = utc_day_bounds(day)
    with database() as session:
        expected = to_csv(usage_report(session, start=start, end=end, group_by="request")).encode()

    status, out, _ = run(capsys, "billing", "download", export["id"])
    assert status == 0 and "verified" in out
    assert (tmp_path / export["file_name"]).read_bytes() == expected
    rows = list(csv.DictReader(io.StringIO(expected.decode())))
    assert len(rows) == 2

    status, _, _ = run(capsys, "billing", "download", export["id"], "-o", "out/x.csv")
    assert status == 2  # no such folder: nothing written
    status, _, _ = run(capsys, "billing", "download", export["id"], "-o", "x.csv")
    assert status == 0 and (tmp_path / "x.csv").read_bytes() == expected
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".csv", ".part")) == [
        export["file_name"],
        "x.csv",
    ]

    try:
        status = main(["billing", "download", export["id"], "-o", "-"])
    finally:
        captured = capsysbinary.readouterr()
    assert status == 0 and captured.out == expected


def test_billing_download_of_an_unknown_or_corrupt_export(capsys, database, tmp_path):
    status, _, err = run(capsys, "billing", "download", "no-such-id")
    assert status == 2 and "No billing export with id 'no-such-id'" in err

    _usage(database, _at(_days_ago(3)))
    export = json.loads(
        run(capsys, "billing", "export", "--day", _days_ago(3).isoformat(), "--json")[1]
    )
    stored = tmp_path / "data" / "store" / export["key"]
    stored.write_bytes(stored.read_bytes().replace(b"\r\n", b"\n"))

    status, _, err = run(capsys, "billing", "download", export["id"])
    assert status == 1 and "missing or corrupt" in err
    assert not (tmp_path / export["file_name"]).exists()


# --- dependencies unavailable ----------------------------------------------------------------


def test_no_database_is_1_with_what_to_do(capsys, env, monkeypatch):
    status, _, err = run(capsys, "billing", "list")
    assert status == 1 and "no database at" in err and "--data-dir" in err
    assert not (Path(env["LORAMUX_DATA_DIR"]) / "loramux.db").exists()  # none made

    url = f"postgresql+psycopg://loramux:secret@127.0.0.1:{_closed_port()}/loramux"
    monkeypatch.setenv("LORAMUX_DATABASE_URL", url)
    status, _, err = run(capsys, "usage", "rollup")
    assert status == 1 and "cannot reach the database" in err and "LORAMUX_DATABASE_URL" in err
    assert "secret" not in err


def test_a_bad_setting_is_2_naming_its_variable(capsys, env, monkeypatch):
    monkeypatch.setenv("LORAMUX_ENGINE_MAX_NUM_SEQS", "0")  # an engine setting, nested
    status, _, err = run(capsys, "billing", "list")
    assert status == 2 and "invalid settings" in err and "LORAMUX_ENGINE_MAX_NUM_SEQS" in err


def test_an_unmigrated_database_is_1(capsys, env, monkeypatch, postgres_database_url):
    monkeypatch.setenv("LORAMUX_DATABASE_URL", postgres_database_url)
    status, _, err = run(capsys, "billing", "list")
    assert status == 1 and "schema revision none" in err and "loramux serve" in err


def test_a_store_outage_is_1_and_records_nothing(capsys, database, tmp_path):
    _usage(database, _at(_days_ago(3)))
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "store").write_text("not a directory")

    status, _, err = run(capsys, "billing", "export", "--day", _days_ago(3).isoformat())

    assert status == 1 and "object store is unavailable" in err
    assert run(capsys, "billing", "list", "--json")[1].strip() == "[]"


# --- engines ---------------------------------------------------------------------------------


@pytest.fixture
def registry_url(env, monkeypatch, redis_url) -> Iterator[str]:
    url = f"{redis_url.rsplit('/', 1)[0]}/{REGISTRY_DB}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    monkeypatch.setenv("LORAMUX_REDIS_URL", url)
    try:
        yield url
    finally:
        client.flushdb()
        client.close()


def _publish(url: str, *records: EngineRecord) -> None:
    async def publish() -> None:
        client = redis.asyncio.from_url(url)
        try:
            registry = EngineRegistry(client, heartbeat_s=30)
            for record in records:
                await registry.publish(record)
        finally:
            await client.aclose()

    _on_a_thread(lambda: asyncio.run(publish()))


def _record(engine_id: str, **fields) -> EngineRecord:
    values = {
        "url": f"http://{engine_id}:8100",
        "model_id": "SmolLM2-135M-Instruct",
        "boot_id": "b",
        "capacity": 64,
        "running": 0,
        "waiting": 0,
        "max_model_len": 8192,
        **fields,
    }
    return EngineRecord(engine_id=engine_id, **values)


def test_engines_lists_the_live_engines(capsys, registry_url):
    assert "No live engine" in run(capsys, "engines")[1]
    _publish(
        registry_url,
        _record("gpu-a", running=3, waiting=1, device_adapters=("acme/bot",),
                host_adapters=("acme/bot", "globex/faq"), heartbeat_at=time.time() - 2),
        _record("gpu-b", capacity=32),
    )  # fmt: skip

    status, out, err = run(capsys, "engines")

    assert (status, err) == (0, "")
    header, first, second = out.strip().splitlines()
    assert header.split()[:3] == ["ENGINE", "URL", "MODEL"]
    assert first.split()[:6] == ["gpu-a", "http://gpu-a:8100", "SmolLM2-135M-Instruct", "4/64",
                                 "(3+1)", "1"]  # fmt: skip
    assert first.split()[6] == "2"  # adapters in host RAM
    assert 1.5 < float(first.split()[7]) < 30  # seconds since the heartbeat
    assert second.split()[:5] == ["gpu-b", "http://gpu-b:8100", "SmolLM2-135M-Instruct", "0/32",
                                  "(0+0)"]  # fmt: skip
    assert "acme/bot" not in out

    verbose = run(capsys, "engines", "--verbose")[1]
    assert "device:   acme/bot" in verbose and "host RAM: acme/bot, globex/faq" in verbose
    listed = json.loads(run(capsys, "engines", "--json")[1])
    assert [e["engine_id"] for e in listed] == ["gpu-a", "gpu-b"]
    assert listed[0]["load"] == 4 and listed[0]["host_adapters"] == ["acme/bot", "globex/faq"]
    assert listed[0]["heartbeat_age_s"] >= 2


def test_engines_without_redis_is_1_with_what_to_do(capsys, env, monkeypatch):
    status, out, err = run(capsys, "engines")
    assert status == 1 and out == "" and "LORAMUX_REDIS_URL is unset" in err

    monkeypatch.setenv("LORAMUX_REDIS_URL", f"redis://:pw@127.0.0.1:{_closed_port()}/0")
    started = time.monotonic()
    status, _, err = run(capsys, "engines")
    assert status == 1 and "cannot reach Redis" in err and ":***@" in err and "pw" not in err
    assert time.monotonic() - started < 30


# --- the console script ----------------------------------------------------------------------


def test_the_console_script_lists_and_exports(database, env, tmp_path):
    _usage(database, _at(_days_ago(3)))
    script = Path(sys.executable).with_name("loramux")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "loramux.platform.cli"]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("LORAMUX_")}
    environment.update(env)

    def loramux(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*command, *argv], capture_output=True, text=True, env=environment, timeout=120
        )

    helped = loramux("--help")
    assert helped.returncode == 0 and all(
        c in helped.stdout for c in ("usage", "billing", "engines")
    )
    exported = loramux("billing", "export", "--day", _days_ago(3).isoformat())
    assert exported.returncode == 0, exported.stderr
    listed = loramux("billing", "list")
    assert listed.returncode == 0 and f"billing/{_days_ago(3).isoformat()}" in listed.stdout
    refused = loramux("billing", "export", "--day", "2999-01-01")
    assert refused.returncode == 2 and "in the future" in refused.stderr
