"""What a benchmark run measured, computed from per-request records.

A driver fills one :class:`RequestRecord` per request; :func:`summarize` reduces them to a
JSON-able dict. The rules:

- Latencies count from ``arrival_s`` (when the workload said the request was due), not from
  ``sent_s``, so a driver that falls behind shows up as latency rather than hiding it.
- A request is *ok* when it has no ``error`` and a ``finish_s``; otherwise it is *failed*.
  Failed requests are counted but left out of every latency, throughput and tenant figure.
- TTFT = first token time - arrival; ITLs = gaps between consecutive token times;
  E2E = finish - arrival. ITL percentiles pool the gaps of all ok requests.
- Throughput is over ``duration_s``: ok requests per second and ok requests' output tokens
  per second.
- SLO attainment is the fraction of *all* requests (failed ones never attain) that are ok,
  have TTFT <= ``slo_ttft_s`` (when given; a request without tokens has no TTFT and misses)
  and have every ITL <= ``slo_itl_s`` (when given; zero or one token means no gaps, which
  meets it). None when neither SLO is given.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise, takewhile
from typing import Any

import numpy as np


@dataclass
class RequestRecord:
    """One request as the driver saw it; times are seconds from the start of the run."""

    index: int
    tenant: str
    adapter: int | None
    arrival_s: float
    sent_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    finish_s: float | None = None
    prompt_tokens: int = 0
    error: str | None = None
    # What only the engine driver knows, from the engine's own account of the request:
    # when it was first scheduled (seconds from the run's start) and the prompt tokens
    # found in the prefix cache.
    scheduled_s: float | None = None
    cached_prompt_tokens: int = 0

    @property
    def ok(self) -> bool:
        """No error and a finish time."""
        return self.error is None and self.finish_s is not None

    @property
    def output_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def ttft_s(self) -> float | None:
        """First token time minus arrival; None without tokens."""
        return self.token_times_s[0] - self.arrival_s if self.token_times_s else None

    @property
    def itls_s(self) -> list[float]:
        """Gaps between consecutive token times (one fewer than the tokens)."""
        times = self.token_times_s
        return [b - a for a, b in pairwise(times)]

    @property
    def e2e_s(self) -> float | None:
        """Finish time minus arrival; None without a finish time."""
        return self.finish_s - self.arrival_s if self.finish_s is not None else None


def new_records(requests: Iterable, prompts: dict[int, list[int]]) -> dict[int, RequestRecord]:
    """An empty record per ``workload.WorkloadRequest``, by request index."""
    return {
        r.index: RequestRecord(
            index=r.index,
            tenant=r.tenant,
            adapter=r.adapter,
            arrival_s=r.arrival_s,
            prompt_tokens=len(prompts[r.index]),
        )
        for r in requests
    }


def _key(q: float) -> str:
    return f"p{q:g}"


def percentiles(
    values: Iterable[float], qs: Sequence[float] = (50, 90, 99)
) -> dict[str, float | None]:
    """``{"p50": ..., "p90": ..., "p99": ...}`` with linear interpolation (numpy's default).

    Keys are ``"p"`` + the quantile written with ``:g`` (99.9 gives ``"p99.9"``). Every
    value is None when there is no data.
    """
    data = np.asarray(list(values), dtype=np.float64)
    if data.size == 0:
        return {_key(q): None for q in qs}
    return {_key(q): float(np.percentile(data, q)) for q in qs}


def _latency(values: list[float]) -> dict[str, float | None]:
    stats: dict[str, float | None] = {"mean": float(np.mean(values)) if values else None}
    stats.update(percentiles(values))
    return stats


def _attains(record: RequestRecord, slo_ttft_s: float | None, slo_itl_s: float | None) -> bool:
    if not record.ok:
        return False
    if slo_ttft_s is not None:
        ttft = record.ttft_s
        if ttft is None or ttft > slo_ttft_s:
            return False
    return slo_itl_s is None or all(gap <= slo_itl_s for gap in record.itls_s)


def _tenant_shares(
    ok: list[RequestRecord], tenant_weights: dict[str, float]
) -> dict[str, dict[str, float | int | None]]:
    tokens: dict[str, int] = dict.fromkeys(tenant_weights, 0)
    for record in ok:
        tokens[record.tenant] = tokens.get(record.tenant, 0) + record.output_tokens
    total_tokens = sum(tokens.values())
    total_weight = sum(tenant_weights.values())
    return {
        tenant: {
            "tokens": n,
            "share": n / total_tokens if total_tokens else None,
            "weight_share": tenant_weights.get(tenant, 0.0) / total_weight
            if total_weight
            else None,
        }
        for tenant, n in sorted(tokens.items())
    }


def summarize(
    records: Iterable[RequestRecord],
    *,
    duration_s: float,
    slo_ttft_s: float | None = None,
    slo_itl_s: float | None = None,
    tenant_weights: dict[str, float] | None = None,
) -> dict[str, Any]:
    """A JSON-able summary of ``records`` (see the module docstring for the definitions).

    Keys: ``requests`` ({total, ok, failed}), ``duration_s``, ``ttft_s`` / ``itl_s`` /
    ``e2e_s`` ({mean, p50, p90, p99}, None values without data), ``requests_per_s``,
    ``output_tokens_per_s``, ``slo`` ({ttft_s, itl_s} as given), ``slo_attainment``, and
    ``tenants``: None without ``tenant_weights``, else ``{tenant: {"tokens", "share",
    "weight_share"}}`` over the weighted tenants plus any tenant seen in the records (a
    tenant missing from the weights has weight 0); ``share`` = tokens / all ok tokens,
    ``weight_share`` = weight / sum of weights.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    records = list(records)
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [gap for r in ok for gap in r.itls_s]
    e2es = [r.e2e_s for r in ok if r.e2e_s is not None]
    output_tokens = sum(r.output_tokens for r in ok)
    if (slo_ttft_s is None and slo_itl_s is None) or not records:
        attainment = None
    else:
        met = sum(_attains(r, slo_ttft_s, slo_itl_s) for r in records)
        attainment = met / len(records)
    return {
        "requests": {"total": len(records), "ok": len(ok), "failed": len(records) - len(ok)},
        "duration_s": duration_s,
        "ttft_s": _latency(ttfts),
        "itl_s": _latency(itls),
        "e2e_s": _latency(e2es),
        "requests_per_s": len(ok) / duration_s,
        "output_tokens_per_s": output_tokens / duration_s,
        "slo": {"ttft_s": slo_ttft_s, "itl_s": slo_itl_s},
        "slo_attainment": attainment,
        "tenants": None if tenant_weights is None else _tenant_shares(ok, tenant_weights),
    }


def agreement(a: dict[int, list[int]], b: dict[int, list[int]]) -> dict:
    """Greedy agreement over the requests both systems served (request index -> token ids):
    how many got identical tokens, their common prefixes, the first that differ."""
    common = sorted(set(a) & set(b))
    pairs = (zip(a[i], b[i], strict=False) for i in common)  # shorter sequence ends the prefix
    prefixes = [sum(1 for _ in takewhile(lambda p: p[0] == p[1], pair)) for pair in pairs]
    mismatched = [i for i in common if a[i] != b[i]]
    return {
        "identical_requests": len(common) - len(mismatched),
        "requests": len(common),
        "fraction": round(1 - len(mismatched) / len(common), 4) if common else None,
        "mean_common_prefix_tokens": round(sum(prefixes) / len(prefixes), 2) if common else None,
        "min_common_prefix_tokens": min(prefixes, default=None),
        "mismatched_requests": mismatched[:20],
    }


def memory_high_water() -> dict[str, int | None]:
    """Peak memory of this process so far, in bytes.

    ``rss_peak_bytes`` from ``resource.getrusage`` (ru_maxrss is KiB on Linux, bytes on
    macOS); ``cuda_max_allocated_bytes`` from ``torch.cuda.max_memory_allocated()`` when
    torch is already imported and CUDA is available, else None (torch is never imported
    here: a process that has not imported it has allocated nothing through it).
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss = peak if sys.platform == "darwin" else peak * 1024
    torch = sys.modules.get("torch")
    cuda = None
    if torch is not None and torch.cuda.is_available():
        cuda = int(torch.cuda.max_memory_allocated())
    return {"rss_peak_bytes": int(rss), "cuda_max_allocated_bytes": cuda}
