"""The soak's verdict: responses classified by status, requests per second over time,
lines fitted to RSS, fds and threads after the warm-up, the registration bound, and every
check judged.

Part of the soak (``soak.py``).
"""

from __future__ import annotations

import math
import signal
from collections import Counter
from dataclasses import asdict

from loramux.benchmarks.soak_churn import MAX_CHURNED
from loramux.benchmarks.soak_ledger import Ledger, Outcome
from loramux.benchmarks.soak_tenants import STABLE_ADAPTERS, TENANTS

FD_SLACK = 8  # fds may vary by a few connections and files open at a sample
THREAD_SLACK = 8  # thread pools (anyio's, the loader's) grow on demand up to their caps


def is_failure(outcome: Outcome) -> bool:
    return outcome.status in ("transport", "stream_error") or outcome.status.startswith("5")


def classify(ledger: Ledger) -> dict:
    """Responses by status; which count against the soak (see ``soak.py``)."""
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
    for o in ledger.outcomes:
        if is_failure(o):
            failures.append(o)
        elif o.status == "404" and deleted_meanwhile(o):
            expected_404 += 1
        elif o.status.startswith("4"):
            unexpected_4xx.append(o)
    churn_failures = [e for e in ledger.events if not e.status.startswith("2")]
    by_kind: dict[str, Counter] = {}
    for o in ledger.outcomes:
        by_kind.setdefault(o.kind, Counter())[o.status] += 1
    return {
        "requests": len(ledger.outcomes),
        "by_status": dict(Counter(o.status for o in ledger.outcomes)),
        "by_kind": {kind: dict(counts) for kind, counts in sorted(by_kind.items())},
        "by_target": dict(Counter(o.target for o in ledger.outcomes)),
        "expected_404": expected_404,
        "failures": [asdict(o) for o in failures],
        "unexpected_4xx": [asdict(o) for o in unexpected_4xx],
        "churn": dict(Counter(f"{e.action} {e.status}" for e in ledger.events)),
        "churn_failures": [asdict(e) for e in churn_failures],
    }


def rate_bins(ledger: Ledger, width: float) -> list[dict]:
    """Requests finished per second in each ``width``-second bin, by class (the last bin
    over the time it covers)."""
    bins: dict[int, Counter] = {}
    for o in ledger.outcomes:
        cls = "failed" if is_failure(o) else "ok" if o.status == "200" else "4xx"
        bins.setdefault(int(o.finished_s // width), Counter())[cls] += 1
    end_s = max((o.finished_s for o in ledger.outcomes), default=0.0)
    spans = {k: max(min(width, end_s - k * width), 1e-3) for k in bins}
    return [
        {"t_s": (k + 0.5) * width, **{c: n / spans[k] for c, n in sorted(bins[k].items())}}
        for k in sorted(bins)
    ]


def fit(samples: list[dict], key: str, since_s: float) -> dict | None:
    """A least-squares line through ``key`` over the samples from ``since_s`` on."""
    import numpy as np

    points = [(s["t_s"], s[key]) for s in samples if key in s and s["t_s"] >= since_s]
    if len(points) < 3:
        return None
    t, y = np.array(points, dtype=float).T
    slope, intercept = np.polyfit(t, y, 1)
    residual = y - (slope * t + intercept)
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
        "residual_std": residual.std(),
    }


def registration_bound(args) -> int:
    """Adapter versions the engine may hold registered at once: every live adapter's latest
    version, plus a superseded or deleted one for each request still using it, plus the
    versions superseded within the platform's grace period (one per churn act at most)."""
    from loramux.platform.services.adapter_runtime import SUPERSEDED_GRACE_S

    in_grace = math.ceil(SUPERSEDED_GRACE_S / args.churn_interval) + 1
    return len(TENANTS) * (STABLE_ADAPTERS + MAX_CHURNED) + args.concurrency + in_grace


def judge(args, samples: list[dict], counts: dict, billing: dict, db: dict, ending: dict) -> dict:
    since = args.warmup * args.duration
    registered = max((s.get("registered_adapters", 0) for s in samples), default=0)
    fits = {key: fit(samples, key, since) for key in ("rss_mib", "fds", "threads")}
    tolerances = {"rss_mib": args.rss_tolerance_mib, "fds": FD_SLACK, "threads": THREAD_SLACK}
    growth = {
        key: fits[key] is not None and fits[key]["fitted_rise"] > tolerances[key] for key in fits
    }
    checks = {
        "no 5xx, transport or stream errors": not counts["failures"],
        "no unexpected 4xx": not counts["unexpected_4xx"],
        "churn acts all succeeded": not counts["churn_failures"],
        "billing equals what the API returned": billing["mismatch_count"] == 0
        and not billing["billed_but_not_returned"]
        and billing["requests_billed"] == billing["requests_returned"],
        "no adapter version stuck uploading/validating": db["stuck_versions"] == 0,
        "no provisional usage row left": db["provisional_usage_rows"] == 0,
        "RSS: no growth": not growth["rss_mib"],
        "fds: no growth": not growth["fds"],
        "threads: no growth": not growth["threads"],
        "engine registrations within live adapters + requests": registered
        <= registration_bound(args),
        "nothing left in tmp/uploads or TMPDIR": not ending["leftovers"],
        "SIGTERM: graceful exit": ending["shutdown"]["graceful"]
        and ending["shutdown"]["exit_code"] in (0, -signal.SIGTERM),
    }
    return {
        "warmup_s": since,
        "registered_max": registered,
        "registered_bound": registration_bound(args),
        "fits": fits,
        "tolerances": tolerances,
        "checks": checks,
        "passed": all(checks.values()),
    }
