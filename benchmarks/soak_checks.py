"""The soak's checks after the load: billing against what the API returned, request by
request; the database once the server exited; what uploads and requests left behind.

Part of the soak (``soak.py``).
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import httpx

from loramux.benchmarks.soak_ledger import Ledger, Outcome
from loramux.benchmarks.soak_server import Server, expect

BILLING_WAIT_S = 60.0  # a dropped stream's row is written once the server sees the client left
USAGE_FIELDS = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens", "cost_micro_usd")


def billed_rows(server: Server, dropped: set[str]) -> dict[str, dict]:
    """``/admin/usage`` by request, once every dropped stream's row is there (or timed out)."""
    deadline = time.monotonic() + BILLING_WAIT_S
    with httpx.Client(base_url=server.url, headers=server.admin, timeout=120) as client:
        while True:
            report = expect(
                client.get("/admin/usage", params={"group_by": "request"}), 200, "usage"
            )
            rows = {row["request_id"]: row for row in report["rows"]}
            if dropped <= rows.keys() or time.monotonic() > deadline:
                return rows
            time.sleep(1.0)


def check_billing(server: Server, ledger: Ledger) -> dict:
    """Billing against what the API returned, request by request (see ``soak.py``)."""
    returned = {
        o.request_id: o
        for o in ledger.outcomes
        if o.request_id and (o.usage is not None or o.delivered is not None)
    }
    dropped = {rid for rid, o in returned.items() if o.usage is None and o.delivered}
    rows = billed_rows(server, dropped)
    mismatches = [m for rid, o in returned.items() if (m := _mismatch(o, rows.get(rid)))]
    empty = [rid for rid, o in returned.items() if _tokens(o) == 0]
    completed = [o for o in returned.values() if o.usage is not None]
    cut = [o for o in returned.values() if o.usage is None]
    return {
        "requests_returned": len(returned) - len(empty),  # those that delivered a token
        "requests_without_tokens": len(empty),  # not billed, by design
        "requests_billed": len(rows),
        "billed_but_not_returned": sorted(set(rows) - set(returned))[:20],
        "completed": {
            "requests": len(completed),
            "returned": {f: sum(o.usage[f] for o in completed) for f in USAGE_FIELDS},
            "billed": {
                f: sum(rows[o.request_id][f] for o in completed if o.request_id in rows)
                for f in USAGE_FIELDS
            },
        },
        "dropped": {
            "requests": len(cut),
            "tokens_received": sum(o.delivered for o in cut),
            "tokens_billed": sum(
                rows[o.request_id]["completion_tokens"] for o in cut if o.request_id in rows
            ),
        },
        "mismatches": mismatches[:20],
        "mismatch_count": len(mismatches),
    }


def _tokens(outcome: Outcome) -> int:
    """Completion tokens the client got: its usage's, or those a dropped stream received."""
    return outcome.delivered if outcome.usage is None else outcome.usage["completion_tokens"]


def _mismatch(outcome: Outcome, row: dict | None) -> dict | None:
    if row is None:  # a request that delivered no token is not billed (by design)
        return (
            None
            if _tokens(outcome) == 0
            else {"request_id": outcome.request_id, "why": "not billed"}
        )
    if outcome.usage is not None:
        billed = {f: row[f] for f in USAGE_FIELDS}
        if billed != outcome.usage:
            return {"request_id": outcome.request_id, "returned": outcome.usage, "billed": billed}
        return None
    if row["completion_tokens"] != outcome.delivered or row["finish_reason"] != "abort":
        return {
            "request_id": outcome.request_id,
            "received": outcome.delivered,
            "billed": row["completion_tokens"],
            "finish_reason": row["finish_reason"],
        }
    return None


def read_database(data_dir: Path) -> dict:
    """After the server exited: adapter versions by status, provisional usage rows."""
    db = sqlite3.connect(f"file:{data_dir / 'loramux.db'}?mode=ro", uri=True)
    try:
        versions = dict(db.execute("SELECT status, COUNT(*) FROM adapter_versions GROUP BY status"))
        adapters = db.execute(
            "SELECT SUM(deleted_at IS NULL), SUM(deleted_at IS NOT NULL) FROM adapters"
        ).fetchone()
        provisional = db.execute("SELECT COUNT(*) FROM usage_records WHERE NOT final").fetchone()
    finally:
        db.close()
    return {
        "versions_by_status": versions,
        "stuck_versions": versions.get("uploading", 0) + versions.get("validating", 0),
        "adapters_live": adapters[0] or 0,
        "adapters_deleted": adapters[1] or 0,
        "provisional_usage_rows": provisional[0],
    }


TORCH_CACHE_PREFIX = "torchinductor_"  # torch's per-user cache folder in TMPDIR, kept by design


def leftovers(server: Server) -> list[str]:
    """What uploads and requests left behind: anything in the upload workspace, anything
    in the server's TMPDIR but torch's cache folder."""
    uploads = server.data_dir / "tmp" / "uploads"
    found = (
        [f"tmp/uploads/{name}" for name in sorted(os.listdir(uploads))] if uploads.is_dir() else []
    )
    return found + [
        f"TMPDIR/{name}"
        for name in sorted(os.listdir(server.tmp_dir))
        if not name.startswith(TORCH_CACHE_PREFIX)
    ]
