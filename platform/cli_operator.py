"""The operator's commands of the ``loramux`` CLI: usage roll-up, billing exports, engines.

::

    loramux usage rollup [--day D]
    loramux billing export (--day D | --start D --end D) [--group-by G]
    loramux billing list [--limit N] [--offset N]
    loramux billing download ID [-o FILE]
    loramux engines [--verbose]

Each reads the same ``LORAMUX_*`` settings as ``loramux serve`` (``--data-dir`` as there)
and acts on the database, the object store or Redis directly, through the services the
admin API uses (``loramux.platform.services.rollups`` and ``billing_exports``, the engine
registry), so no platform needs to be running. Days are UTC, ``YYYY-MM-DD``; ``--start`` and
``--end`` are both inclusive. Output is a table for people; ``--json`` prints what the admin
API answers, for scripts. Exit status: 0 done, 2 bad arguments (a period that cannot be
exported, an unknown export id, invalid settings), 1 a dependency is unavailable (database,
object store, Redis) or a stored export is unusable; the message says what to do.

Nothing is built at import: ``cli.py`` calls :func:`add_operator_commands`, and each handler
imports and builds what it needs when it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit, urlunsplit

OK, UNAVAILABLE, BAD_ARGUMENTS = 0, 1, 2
GROUP_BYS = ("day", "adapter", "request")
DB_CONNECT_TIMEOUT_S = 5
REDIS_TIMEOUT_S = 3.0

USAGE_HELP = "Usage roll-ups: sum closed UTC days per tenant, adapter and model."
BILLING_HELP = "Billing exports: export usage as CSV now, list the exports, download one."
ENGINES_HELP = (
    "List the live engines from the Redis registry: URL, model, load, adapters in device "
    "memory and host RAM, seconds since their last heartbeat."
)


class CommandFailed(Exception):
    """Ends a command with ``status`` and ``message`` (printed to stderr)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _unavailable(message: str) -> CommandFailed:
    return CommandFailed(UNAVAILABLE, message)


def _bad(message: str) -> CommandFailed:
    return CommandFailed(BAD_ARGUMENTS, message)


# --- wiring ----------------------------------------------------------------------------------


def _day(text: str) -> date:
    """An argparse type: ``YYYY-MM-DD``."""
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a UTC day written YYYY-MM-DD")
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a calendar day") from None


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--data-dir", help="data directory (default: LORAMUX_DATA_DIR or ./.loramux)"
    )
    common.add_argument("--json", action="store_true", help="print JSON (the API's shapes)")
    return common


def add_operator_commands(commands: argparse._SubParsersAction) -> None:
    """Add ``usage``, ``billing`` and ``engines`` to the ``loramux`` subcommands."""
    common = _common()

    usage = commands.add_parser("usage", help=USAGE_HELP, description=USAGE_HELP)
    usage_commands = usage.add_subparsers(dest="usage_command", metavar="COMMAND", required=True)
    rollup = usage_commands.add_parser(
        "rollup",
        parents=[common],
        help="roll up the closed days not rolled up yet (today is open: not rolled up)",
        description="Roll up every closed UTC day not rolled up yet (a day closes 5 minutes "
        "after the midnight that ends it), or with --day that closed day again.",
    )
    rollup.add_argument("--day", type=_day, help="roll this closed day up again (YYYY-MM-DD)")
    rollup.set_defaults(handler=_handler(_rollup))

    billing = commands.add_parser("billing", help=BILLING_HELP, description=BILLING_HELP)
    billing_commands = billing.add_subparsers(
        dest="billing_command", metavar="COMMAND", required=True
    )
    export = billing_commands.add_parser(
        "export",
        parents=[common],
        help="export a day or a range of days now",
        description="Export every tenant's usage over one UTC day or the days --start to "
        "--end (both inclusive, at most 31) as a CSV in the object store. Today's export is "
        "provisional; a closed period is exported once and exporting it again returns it.",
    )
    export.add_argument("--day", type=_day, help="one UTC day (YYYY-MM-DD), today at the latest")
    export.add_argument("--start", type=_day, help="first UTC day (inclusive)")
    export.add_argument("--end", type=_day, help="last UTC day (inclusive)")
    export.add_argument(
        "--group-by",
        choices=GROUP_BYS,
        help="rows per day, adapter or request (default: LORAMUX_BILLING_EXPORT_GROUP_BY)",
    )
    export.set_defaults(handler=_handler(_export), parser=export)
    listing = billing_commands.add_parser(
        "list", parents=[common], help="the exports, newest first"
    )
    listing.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    listing.add_argument("--offset", type=int, default=0, help="skip this many newest first")
    listing.set_defaults(handler=_handler(_list), parser=listing)
    download = billing_commands.add_parser(
        "download",
        parents=[common],
        help="save an export's CSV (verified against its sha256)",
        description="Save an export's CSV, verified against its recorded sha256 first.",
    )
    download.add_argument("id", help="the export's id (from `loramux billing list`)")
    download.add_argument(
        "-o",
        "--output",
        help="file to write (default: the export's file name here; - for stdout)",
    )
    download.set_defaults(handler=_handler(_download))

    engines = commands.add_parser(
        "engines", parents=[common], help=ENGINES_HELP, description=ENGINES_HELP
    )
    engines.add_argument(
        "-v", "--verbose", action="store_true", help="name the adapters, not only count them"
    )
    engines.set_defaults(handler=_handler(_engines))


def _handler(command: Callable[[argparse.Namespace, Any], int]) -> Callable[..., int]:
    """Run ``command(args, settings)``; a :class:`CommandFailed` becomes its message and status."""

    def run(args: argparse.Namespace) -> int:
        try:
            return command(args, _settings(args))
        except CommandFailed as failed:
            print(f"loramux: {failed.message}", file=sys.stderr)
            return failed.status

    return run


def _settings(args: argparse.Namespace) -> Any:
    from pydantic import ValidationError

    from loramux.platform.settings import Settings
    from loramux.platform.settings_names import env_name

    overrides = {"data_dir": args.data_dir} if args.data_dir else {}
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"{env_name(str(error['loc'][-1]))}: {error['msg']}" if error["loc"] else error["msg"]
            for error in exc.errors()
        )
        raise _bad(f"invalid settings: {problems}") from None


# --- dependencies ----------------------------------------------------------------------------


@dataclass
class _Data:
    sessions: Any  # sessionmaker of the metadata database
    store: Any  # the object store


@contextmanager
def _data(settings: Any) -> Iterator[_Data]:
    """The platform's database (at the current schema) and object store, or exit 1."""
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy.exc import DBAPIError

    from loramux.platform.db.migrate import head
    from loramux.platform.db.session import create_engine_for, database_url, session_factory
    from loramux.platform.store import build_store

    url = database_url(settings.resolved_database_url)
    shown = url.render_as_string(hide_password=True)
    if url.get_backend_name() == "sqlite" and not Path(url.database or "").is_file():
        raise _unavailable(
            f"no database at {url.database}: run this where `loramux serve` keeps its data "
            "(--data-dir or LORAMUX_DATA_DIR), or set LORAMUX_DATABASE_URL to its database"
        )
    options = {}
    if url.get_backend_name() == "postgresql":
        options["connect_args"] = {"connect_timeout": DB_CONNECT_TIMEOUT_S}
    engine = create_engine_for(url, **options)
    try:
        try:
            with engine.connect() as connection:
                revision = MigrationContext.configure(connection).get_current_revision()
        except DBAPIError as exc:
            reason = str(exc.orig or exc).strip().splitlines()[0]
            raise _unavailable(
                f"cannot reach the database at {shown} ({reason}); check that it is running "
                "and that LORAMUX_DATABASE_URL points to it"
            ) from None
        if revision != head():
            raise _unavailable(
                f"the database at {shown} is at schema revision {revision or 'none'}, this "
                f"loramux needs {head()}: start `loramux serve` once (it migrates at start)"
            )
        yield _Data(session_factory(engine), build_store(settings))
    except DBAPIError as exc:
        reason = str(exc.orig or exc).strip().splitlines()[0]
        raise _unavailable(f"the database at {shown} failed ({reason}); try again") from None
    finally:
        engine.dispose()


@contextmanager
def _store_errors() -> Iterator[None]:
    from loramux.platform.store import StoreUnavailable

    try:
        yield
    except StoreUnavailable as exc:
        raise _unavailable(
            f"the object store is unavailable ({exc}); nothing was changed. Check "
            "LORAMUX_STORE_BACKEND / LORAMUX_S3_* and try again"
        ) from None


# --- output ----------------------------------------------------------------------------------


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell, two spaces apart."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in cells
    )


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    if n < 1024 * 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n / (1024 * 1024):.1f} MiB"


def _without_password(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``, for messages."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def _period(first: date, last: date) -> str:
    return first.isoformat() if first == last else f"{first.isoformat()} .. {last.isoformat()}"


# --- usage rollup ----------------------------------------------------------------------------


def _rollup(args: argparse.Namespace, settings: Any) -> int:
    from loramux.platform.api.admin.billing_schemas import RollupOut
    from loramux.platform.db.types import utc_now
    from loramux.platform.services.rollups import InvalidPeriod, run_rollup

    with _data(settings) as data:
        try:
            run = run_rollup(data.sessions, now=utc_now(), day=args.day)
        except InvalidPeriod as exc:
            raise _bad(f"cannot roll that day up: {exc}") from None
    if args.json:
        _print_json(RollupOut.from_run(run).model_dump(mode="json"))
        return OK
    print(run.note)
    return OK


# --- billing ---------------------------------------------------------------------------------


def _export(args: argparse.Namespace, settings: Any) -> int:
    from loramux.platform.api.admin.billing_schemas import ExportCreatedOut
    from loramux.platform.db.types import utc_now
    from loramux.platform.services.billing_exports import DayRange, export_period
    from loramux.platform.services.rollups import InvalidPeriod

    if args.day is not None and (args.start is not None or args.end is not None):
        args.parser.error("give --day, or --start and --end, not both")
    if args.day is None and (args.start is None or args.end is None):
        args.parser.error("give --day, or both --start and --end")
    group_by = args.group_by or settings.billing_export_group_by
    with _data(settings) as data, _store_errors():
        try:
            first, last = (args.day, args.day) if args.day else (args.start, args.end)
            outcome = export_period(
                data.sessions, data.store, DayRange(first, last), group_by=group_by, now=utc_now()
            )
        except InvalidPeriod as exc:
            raise _bad(f"this period cannot be exported: {exc}") from None
    out = ExportCreatedOut.from_outcome(outcome)
    if args.json:
        _print_json(out.model_dump(mode="json"))
        return OK
    state = "provisional" if out.provisional else "final"
    verb = "Exported" if out.created else "Existing export of"
    period = _period(out.first_day, out.last_day)
    print(f"{verb} {period} by {out.group_by}: version {out.version}, {state}")
    for label, value in (
        ("id", out.id),
        ("key", out.key),
        ("rows", out.rows),
        ("size", _size(out.size_bytes)),
        ("sha256", out.sha256),
        ("created", out.created_at.strftime("%Y-%m-%d %H:%M:%S UTC")),
    ):
        print(f"  {label:<8} {value}")
    print(out.note)
    return OK


def _list(args: argparse.Namespace, settings: Any) -> int:
    from loramux.platform.api.admin.billing_schemas import ExportOut
    from loramux.platform.services.billing_exports import list_exports

    if args.limit < 1 or args.offset < 0:
        args.parser.error("--limit must be at least 1 and --offset at least 0")
    with _data(settings) as data, data.sessions() as session:
        exports = [
            ExportOut.from_export(e)
            for e in list_exports(session, limit=args.limit, offset=args.offset)
        ]
    if args.json:
        _print_json([e.model_dump(mode="json") for e in exports])
        return OK
    if not exports:
        print("No billing exports yet: `loramux billing export --day YYYY-MM-DD` makes one.")
        return OK
    rows = [
        (
            e.id,
            _period(e.first_day, e.last_day),
            e.group_by,
            e.version,
            "provisional" if e.provisional else "final",
            e.rows,
            _size(e.size_bytes),
            e.created_at.strftime("%Y-%m-%d %H:%M"),
            e.key,
        )
        for e in exports
    ]
    headers = ["ID", "PERIOD", "GROUP BY", "V", "STATE", "ROWS", "SIZE", "CREATED (UTC)", "KEY"]
    print(table(headers, rows))
    return OK


def _download(args: argparse.Namespace, settings: Any) -> int:
    from loramux.platform.services.billing_exports import (
        ExportNotFound,
        export_file_name,
        get_export,
        read_export,
    )
    from loramux.platform.store import ChecksumMismatch, ObjectNotFound

    with _data(settings) as data, _store_errors():
        with data.sessions() as session:
            try:
                export = get_export(session, args.id)
            except ExportNotFound as exc:
                raise _bad(f"{exc} `loramux billing list` shows the exports.") from None
        try:
            copy = read_export(data.store, export)
        except (ChecksumMismatch, ObjectNotFound) as exc:
            raise _unavailable(
                f"the stored file of export {export.id} is missing or corrupt ({exc}); "
                "GET /admin/usage?format=csv rebuilds its rows from the usage records"
            ) from None
    with copy:
        if args.output == "-":
            _copy_to(copy, sys.stdout.buffer)
            sys.stdout.flush()
            return OK
        target = Path(args.output or export_file_name(export))
        _write_atomically(copy, target)
    message = f"Saved {target} ({_size(export.size_bytes)}, sha256 {export.sha256} verified)"
    if args.json:
        _print_json({"id": export.id, "path": str(target.resolve()), "sha256": export.sha256})
    else:
        print(message)
    return OK


def _copy_to(source: IO[bytes], out: IO[bytes]) -> None:
    while chunk := source.read(1024 * 1024):
        out.write(chunk)


def _write_atomically(source: IO[bytes], target: Path) -> None:
    """Write ``target`` whole or not at all (a temporary file renamed into place)."""
    directory = target.parent if str(target.parent) else Path(".")
    try:
        fd, temporary = tempfile.mkstemp(dir=directory, prefix=f".{target.name}.", suffix=".part")
    except OSError as exc:
        raise _bad(f"cannot write to {directory}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as out:
            _copy_to(source, out)
        os.replace(temporary, target)
    except OSError as exc:
        Path(temporary).unlink(missing_ok=True)
        raise _bad(f"cannot write {target}: {exc.strerror}") from None


# --- engines ---------------------------------------------------------------------------------


def _engines(args: argparse.Namespace, settings: Any) -> int:
    import asyncio

    if not settings.redis_url:
        raise _unavailable(
            "LORAMUX_REDIS_URL is unset: engines register in Redis only when they run as "
            "`loramux engine` processes (LORAMUX_ENGINE_MODE=remote). Set it to that Redis; "
            "an embedded platform's in-process engine is at GET /admin/engine instead"
        )
    records = asyncio.run(_live_engines(settings))
    now = time.time()
    if args.json:
        _print_json(
            [
                {
                    **record_json(record),
                    "load": record.load,
                    "heartbeat_age_s": round(now - record.heartbeat_at, 3),
                }
                for record in records
            ]
        )
        return OK
    if not records:
        print(
            "No live engine in the registry: start `loramux engine` processes with the same "
            "LORAMUX_REDIS_URL (each heartbeats every LORAMUX_ENGINE_SERVER_HEARTBEAT_S seconds)."
        )
        return OK
    rows = []
    for record in records:
        rows.append(
            (
                record.engine_id,
                record.url,
                record.model_id,
                f"{record.load}/{record.capacity} ({record.running}+{record.waiting})",
                len(record.device_adapters),
                len(record.host_adapters),
                f"{max(0.0, now - record.heartbeat_at):.1f} s",
            )
        )
    headers = ["ENGINE", "URL", "MODEL", "LOAD (RUN+WAIT)", "DEVICE", "HOST RAM", "HEARTBEAT"]
    print(table(headers, rows))
    if args.verbose:
        for record in records:
            print(f"\n{record.engine_id}")
            print(f"  device:   {', '.join(record.device_adapters) or '(none)'}")
            print(f"  host RAM: {', '.join(record.host_adapters) or '(none)'}")
    return OK


def record_json(record: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return {
        key: list(value) if isinstance(value, tuple) else value
        for key, value in asdict(record).items()
    }


async def _live_engines(settings: Any) -> list[Any]:
    import redis.asyncio
    from redis.exceptions import RedisError

    from loramux.platform.engine_fleet.registry import EngineRegistry

    shown = _without_password(settings.redis_url)
    client = redis.asyncio.from_url(
        settings.redis_url,
        socket_connect_timeout=REDIS_TIMEOUT_S,
        socket_timeout=REDIS_TIMEOUT_S,
    )
    try:
        return await EngineRegistry(client, settings.engine_heartbeat_s).live()
    except (RedisError, OSError) as exc:
        raise _unavailable(
            f"cannot reach Redis at {shown} ({exc}); the engine registry lives there: check "
            "that Redis is running and that LORAMUX_REDIS_URL points to it"
        ) from None
    finally:
        await client.aclose()
