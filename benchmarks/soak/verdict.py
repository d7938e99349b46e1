"""The soak's judgement: billing against what the API returned, responses by status and over
time, the fits of RSS, fds and threads, the registration bound, every check."""

from __future__ import annotations

import math
import signal
import time
from collections import Counter
from dataclasses import asdict

import httpx
import numpy as np

from loramux.benchmarks.common.bench_server import expect
from loramux.benchmarks.common.serve_process import Server
from loramux.benchmarks.soak.load import MAX_CHURNED, STABLE_ADAPTERS, TENANTS, Ledger, Outcome

BILLING_WAIT_S = 60.0  # a dropped stream's row is written once the server sees the client left
USAGE_FIELDS = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens", "cost_micro_usd")
FD_SLACK = 8  # fds may vary by a few connections and files open at a sample
THREAD_SLACK = 8  # thread pools (anyio's, the loader's) grow on demand up to their caps


def check_billing(server: Server, ledger: Ledger) -> dict:
    """Billing against what the API returned, request by request (see ``runner.py``), once
    every dropped stream's row is there (or ``BILLING_WAIT_S`` passed)."""
    returned = {o.request_id: o for o in ledger.outcomes if _tokens(o) is not None}
    completed = [o for o in returned.values() if o.usage is not None]
    cut = [o for o in returned.values() if o.usage is None]
    dropped = {o.request_id for o in cut if o.delivered}
    deadline = time.monotonic() + BILLING_WAIT_S
    with httpx.Client(base_url=server.url, headers=server.admin, timeout=120) as client:
        while True:
            usage = client.get("/admin/usage", params={"group_by": "request"})
            rows = {row["request_id"]: row for row in expect(usage, 200, "usage")["rows"]}
            if dropped <= rows.keys() or time.monotonic() > deadline:
                break
            time.sleep(1.0)
    mismatches = [m for rid, o in returned.items() if (m := _mismatch(o, rows.get(rid)))]
    empty = sum(_tokens(o) == 0 for o in returned.values())
    billed = [rows[o.request_id] for o in completed if o.request_id in rows]
    return {
        "requests_returned": len(returned) - empty,  # those that delivered a token
        "requests_without_tokens": empty,  # not billed, by design
        "requests_billed": len(rows),
        "billed_but_not_returned": sorted(set(rows) - set(returned))[:20],
        "completed": {
            "requests": len(completed),
            "returned": {f: sum(o.usage[f] for o in completed) for f in USAGE_FIELDS},
            "billed": {f: sum(row[f] for row in billed) for f in USAGE_FIELDS},
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


def _tokens(outcome: Outcome) -> int | None:
    """Completion tokens the client got: its usage's, or those a dropped stream received
    (None for a request that returned neither)."""
    return outcome.delivered if outcome.usage is None else outcome.usage["completion_tokens"]


def _mismatch(outcome: Outcome, row: dict | None) -> dict | None:
    rid = outcome.request_id
    if row is None:  # a request that delivered no token is not billed (by design)
        return None if _tokens(outcome) == 0 else {"request_id": rid, "why": "not billed"}
    if outcome.usage is not None:
        billed = {f: row[f] for f in USAGE_FIELDS}
        if billed != outcome.usage:
            return {"request_id": rid, "returned": outcome.usage, "billed": billed}
    elif row["completion_tokens"] != outcome.delivered or row["finish_reason"] != "abort":
        return {
            "request_id": rid,
            "received": outcome.delivered,
            "billed": row["completion_tokens"],
            "finish_reason": row["finish_reason"],
        }
    return None


def response_class(outcome: Outcome) -> str:
    """failed (5xx, a transport error or an error in a stream), ok (200) or 4xx."""
    if outcome.status in ("transport", "stream_error") or outcome.status.startswith("5"):
        return "failed"
    return "ok" if outcome.status == "200" else "4xx"


def classify(ledger: Ledger) -> dict:
    """Responses by status; which count against the soak (see ``runner.py``)."""
    deletes = [e for e in ledger.events if e.action == "delete"]

    def deleted_meanwhile(o: Outcome) -> bool:
        return any(
            e.tenant == o.tenant
            and e.name == o.model
            and e.started_s <= o.finished_s
            and e.finished_s >= o.picked_s
            for e in deletes
        )

    failures, expected_404, unexpected_4xx = [], 0, []
    by_kind: dict[str, Counter] = {}
    for o in ledger.outcomes:
        by_kind.setdefault(o.kind, Counter())[o.status] += 1
        if response_class(o) == "failed":
            failures.append(asdict(o))
        elif o.status == "404" and deleted_meanwhile(o):
            expected_404 += 1
        elif o.status.startswith("4"):
            unexpected_4xx.append(asdict(o))
    return {
        "requests": len(ledger.outcomes),
        "by_status": dict(Counter(o.status for o in ledger.outcomes)),
        "by_kind": {kind: dict(counts) for kind, counts in sorted(by_kind.items())},
        "by_target": dict(Counter(o.target for o in ledger.outcomes)),
        "expected_404": expected_404,
        "failures": failures,
        "unexpected_4xx": unexpected_4xx,
        "churn": dict(Counter(f"{e.action} {e.status}" for e in ledger.events)),
        "churn_failures": [asdict(e) for e in ledger.events if not e.status.startswith("2")],
    }


def rate_bins(ledger: Ledger, width: float) -> list[dict]:
    """Requests finished per second in each ``width``-second bin, by class (the last bin
    over the time it covers)."""
    bins: dict[int, Counter] = {}
    for o in ledger.outcomes:
        bins.setdefault(int(o.finished_s // width), Counter())[response_class(o)] += 1
    end_s = max((o.finished_s for o in ledger.outcomes), default=0.0)
    spans = {k: max(min(width, end_s - k * width), 1e-3) for k in bins}
    return [
        {"t_s": (k + 0.5) * width, **{c: n / spans[k] for c, n in sorted(bins[k].items())}}
        for k in sorted(bins)
    ]


def fit(samples: list[dict], key: str, since_s: float) -> dict | None:
    """A least-squares line through ``key`` over the samples from ``since_s`` on."""
    points = [(s["t_s"], s[key]) for s in samples if key in s and s["t_s"] >= since_s]
    if len(points) < 3:
        return None
    t, y = np.array(points, dtype=float).T
    slope, intercept = np.polyfit(t, y, 1)
    late = t >= (t[0] + t[-1]) / 2  # a leak keeps its slope; a cache filling up flattens
    late_slope = np.polyfit(t[late], y[late], 1)[0] if late.sum() >= 3 else None
    return {
        "samples": len(points),
        "from_s": t[0],
        "to_s": t[-1],
        "first": y[0],
        "last": y[-1],
        "min": y.min(),
        "max": y.max(),
        "slope_per_min": slope * 60,
        "intercept": intercept,  # at 0 s, in minutes: y = intercept + slope_per_min * min
        "second_half_slope_per_min": None if late_slope is None else late_slope * 60,
        "fitted_rise": slope * (t[-1] - t[0]),
        "residual_std": (y - (slope * t + intercept)).std(),
    }


def judge(args, report: dict) -> dict:
    """Every check of the soak on ``report``'s figures.

    The registration bound: adapter versions the engine may hold registered at once are
    every live adapter's latest version, plus a superseded or deleted one for each request
    still using it, plus the versions superseded within the platform's grace period (one
    per churn act at most)."""
    from loramux.platform.services.adapter_runtime import SUPERSEDED_GRACE_S

    samples, counts, billing = report["samples"], report["counts"], report["billing"]
    db, ending = report["database"], report["ending"]
    since = args.warmup * args.duration
    registered = max((s.get("registered_adapters", 0) for s in samples), default=0)
    in_grace = math.ceil(SUPERSEDED_GRACE_S / args.churn_interval) + 1
    bound = len(TENANTS) * (STABLE_ADAPTERS + MAX_CHURNED) + args.concurrency + in_grace
    fits = {key: fit(samples, key, since) for key in ("rss_mib", "fds", "threads")}
    tolerances = {"rss_mib": args.rss_tolerance_mib, "fds": FD_SLACK, "threads": THREAD_SLACK}
    steady = {key: fits[key] is None or fits[key]["fitted_rise"] <= tolerances[key] for key in fits}
    checks = {
        "no 5xx, transport or stream errors": not counts["failures"],
        "no unexpected 4xx": not counts["unexpected_4xx"],
        "churn acts all succeeded": not counts["churn_failures"],
        "billing equals what the API returned": billing["mismatch_count"] == 0
        and not billing["billed_but_not_returned"]
        and billing["requests_billed"] == billing["requests_returned"],
        "no adapter version stuck uploading/validating": db["stuck_versions"] == 0,
        "no provisional usage row left": db["provisional_usage_rows"] == 0,
        "RSS: no growth": steady["rss_mib"],
        "fds: no growth": steady["fds"],
        "threads: no growth": steady["threads"],
        "engine registrations within live adapters + requests": registered <= bound,
        "nothing left in tmp/uploads or TMPDIR": not ending["leftovers"],
        "SIGTERM: graceful exit": ending["shutdown"]["graceful"]
        and ending["shutdown"]["exit_code"] in (0, -signal.SIGTERM),
    }
    return {
        "warmup_s": since,
        "registered_max": registered,
        "registered_bound": bound,
        "fits": fits,
        "tolerances": tolerances,
        "checks": checks,
        "passed": all(checks.values()),
    }
