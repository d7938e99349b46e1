"""``loramux bench fairness-slo``'s figures, plots and markdown from the run's records.

* **Share**: each weighted tenant's output tokens received (stamped as their chunks
  arrived) per ``bucket`` seconds, as a fraction of the three weighted tenants' tokens in
  that bucket; over the whole window, and its ratio to the weight's share (w / sum w).
  ``share_max_deviation`` is the largest |ratio - 1| over the tenants and over every run
  of consecutive buckets spanning 30 s (the issue's "any 30-second window"; the whole
  window when shorter).
* **TTFT** per priority class, from sending to the first token's chunk, of the requests
  that got one: the priority tenant idle and under the flood (median and P99; with a few
  dozen probes the P99 is about the worst), the weighted tenants under the flood.
* **SLO attainment** per class and tenant, over the requests sent in the window: met when
  the first token came within the class's TTFT target and the request ended normally
  before its deadline; given over every request sent and over those admitted (not 429/503).
* **Shed and expired** per tenant, as the client saw them (429 queue_full, 503
  deadline_unattainable, deadline_exceeded before or after a first token) over the whole
  run, next to ``/metrics``' counters.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from loramux.benchmarks.common.files import pyplot, save_figure
from loramux.benchmarks.common.machine import machine_text
from loramux.benchmarks.common.report import Markdown, num, pct, write
from loramux.benchmarks.serve.presets import judge_goals

SHARE_SPAN_S = 30.0
OUTCOMES = ("queue_full", "deadline_unattainable", "expired_queued", "expired_generating")
WEIGHTED = "priority 5 (w1, w2, w4)"


def _stats(values: list[float]) -> dict:
    ms = np.asarray(values) * 1000
    return {"n": len(values)} | {
        f"{key}_ms": round(float(np.percentile(ms, q)), 1) if len(ms) else None
        for key, q in (("p50", 50), ("p99", 99), ("max", 100))
    }


def _ttfts(records: list[dict]) -> list[float]:
    return [r["token_times_s"][0] - r["sent_s"] for r in records if r["token_times_s"]]


def _outcome(record: dict) -> str:
    if record["outcome"] == "expired":
        return "expired_generating" if record["token_times_s"] else "expired_queued"
    return record["outcome"]


def _shares(flood: list[dict], weighted: dict[str, float], window, bucket: float) -> dict:
    end = max([window[1], *(t for r in flood for t in r["token_times_s"][-1:])])
    edges = np.arange(0.0, end + bucket, bucket)
    tokens = {
        name: np.histogram(
            [t for r in flood if r["tenant"] == name for t in r["token_times_s"]], bins=edges
        )[0]
        for name in weighted
    }
    total = sum(tokens.values())
    # The buckets wholly inside the window, and every run of them spanning SHARE_SPAN_S.
    inside = [
        i for i in range(len(edges) - 1) if edges[i] >= window[0] and edges[i + 1] <= window[1]
    ]
    span = max(1, min(len(inside), round(SHARE_SPAN_S / bucket)))
    spans = [inside[k : k + span] for k in range(len(inside) - span + 1)]
    everyone = int(total[inside].sum())
    total_w = sum(weighted.values())
    per_tenant, deviation = {}, 0.0
    for name, weight in weighted.items():
        weight_share = weight / total_w
        ratios = [
            int(tokens[name][s].sum()) / int(total[s].sum()) / weight_share
            for s in spans
            if total[s].sum()
        ]
        mine = int(tokens[name][inside].sum())
        share = mine / everyone if everyone else math.nan
        ratio = share / weight_share
        deviation = max([deviation, abs(ratio - 1), *(abs(r - 1) for r in ratios)])
        per_tenant[name] = {
            "weight": weight,
            "weight_share": round(weight_share, 4),
            "tokens": mine,
            "share": round(share, 4),
            "ratio": round(ratio, 3),
            "ratio_30s_min": round(min(ratios), 3) if ratios else None,
            "ratio_30s_max": round(max(ratios), 3) if ratios else None,
        }
    return {
        "bucket_s": bucket,
        "span_s": span * bucket,
        "edges_s": [round(float(e), 3) for e in edges],
        "tokens": {name: counts.tolist() for name, counts in tokens.items()},
        "window_buckets": [inside[0], inside[-1]] if inside else None,
        "tenants": per_tenant,
        "max_deviation": round(deviation, 4),
    }


def _attainment(records: list[dict], slo) -> dict:
    admitted = [r for r in records if r["outcome"] not in ("queue_full", "deadline_unattainable")]
    met = [
        r
        for r in admitted
        if r["outcome"] == "ok"
        and r["token_times_s"]
        and r["token_times_s"][0] - r["sent_s"] <= slo.ttft_s
        and r["finish_s"] - r["sent_s"] <= slo.timeout_s
    ]
    return {
        "sent": len(records),
        "admitted": len(admitted),
        "met": len(met),
        "attainment": round(len(met) / len(records), 4) if records else None,
        "attainment_admitted": round(len(met) / len(admitted), 4) if admitted else None,
    }


def _shed(records: list[dict], tenants: dict, metrics: dict) -> dict:
    out = {}
    for name in tenants:
        mine = [_outcome(r) for r in records if r["tenant"] == name]
        client = {kind: mine.count(kind) for kind in OUTCOMES}
        client["errors"] = sum(1 for o in mine if o.startswith("error"))
        shed = metrics["loramux_requests_shed"].get(name, {})
        expired = metrics["loramux_requests_expired"].get(name, {})
        server = {kind: shed.get(kind, 0) for kind in OUTCOMES[:2]} | {
            f"expired_{state}": expired.get(state, 0) for state in ("queued", "generating")
        }
        out[name] = {
            "client": client,
            "metrics": server,
            "matches": all(client[k] == server[k] for k in OUTCOMES),
        }
    return out


def summarize(run: dict, tenants: dict, slos: dict, bucket: float, goals) -> dict:
    """The report's figures from ``runner.run_phases``' run and ``/metrics``."""
    window, flood, idle = run["window_s"], run["flood"], run["idle"]
    weighted = {n: t["weight"] for n, t in tenants.items() if t["priority"] == 5}
    in_window = [r for r in flood if window[0] <= r["sent_s"] < window[1]]

    def of(*names: str) -> list[dict]:
        return [r for r in in_window if r["tenant"] in names]

    probes, loaded = of("priority"), of(*weighted)
    ttft = {
        "priority_idle": _stats(_ttfts(idle)),
        "priority_flood": _stats(_ttfts(probes)),
        "weighted_flood": _stats(_ttfts(loaded)),
        **{f"{n}_flood": _stats(_ttfts(of(n))) for n in weighted},
    }
    idle_s, flood_s = ttft["priority_idle"], ttft["priority_flood"]
    ratio = {
        q: round(flood_s[f"{q}_ms"] / idle_s[f"{q}_ms"], 3)
        if flood_s["n"] and idle_s["n"]
        else None
        for q in ("p50", "p99")
    }
    samples = [s for s in run["engine_samples"] if window[0] <= s["t_s"] < window[1]]
    engine = {}
    for name in tenants:
        queued = [s["tenants"].get(name, {}).get("queued_requests", 0) for s in samples]
        engine[name] = {
            "backlogged_fraction": round(sum(q > 0 for q in queued) / len(queued), 3)
            if queued
            else None,
            "mean_queued": round(float(np.mean(queued)), 2) if queued else None,
        }
    loads = [s["loadavg_1m"] for s in samples]
    load = {"mean": round(float(np.mean(loads)), 2), "max": round(max(loads), 2)} if loads else None
    shares = _shares(flood, weighted, window, bucket)
    figures = {
        "share_max_deviation": shares["max_deviation"],
        "priority_ttft_p50_ratio": ratio["p50"],
        "priority_ttft_p99_ratio": ratio["p99"],
    }
    unjudged = None if all(v is not None for v in figures.values()) else "a figure is missing"
    everything = [*run["warmup"], *idle, *flood]
    served = run["metrics"]["loramux_tenant_served_tokens"]
    return {
        "figures": figures,
        "goals": judge_goals(goals, figures, unjudged=unjudged, failed=None),
        "shares": shares,
        "ttft": ttft,
        "ttft_samples_s": {
            label: sorted(round(x, 4) for x in _ttfts(records))
            for label, records in (
                ("priority idle", idle),
                ("priority 9 under flood", probes),
                (WEIGHTED, loaded),
            )
        },
        "slo_attainment": {
            WEIGHTED: _attainment(loaded, slos[5]),
            "priority 9": _attainment(probes, slos[9]),
            **{n: _attainment(of(n), slos[tenants[n]["priority"]]) for n in weighted},
        },
        "shed_expired": _shed(everything, tenants, run["metrics"]),
        "served_output_tokens": {
            n: {
                "client": sum(len(r["token_times_s"]) for r in everything if r["tenant"] == n),
                "metrics": served.get(n, {}).get("output"),
            }
            for n in tenants
        },
        "engine_samples_in_window": len(samples),
        "loadavg_1m_in_window": load,
        "engine": engine,
    }


def compact(run: dict) -> dict:
    """``run`` with each request's token stamps replaced by its count (for the JSON)."""

    def short(r: dict) -> dict:
        times = r["token_times_s"]
        return {
            **{k: v for k, v in r.items() if k != "token_times_s"},
            "tokens": len(times),
            "first_token_s": times[0] if times else None,
        }

    return run | {
        "idle": [short(r) for r in run["idle"]],
        "flood": [short(r) for r in run["flood"]],
    }


def write_plots(report: dict, stem: Path) -> list[Path]:
    """The share-over-time plot and the TTFT CDFs (none without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return []
    shares, note = report["shares"], machine_text(report["machine"])[:110]
    edges = np.asarray(shares["edges_s"])
    mids = (edges[:-1] + edges[1:]) / 2
    totals = np.sum([np.asarray(c) for c in shares["tokens"].values()], axis=0)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for k, (name, counts) in enumerate(shares["tokens"].items()):
        color = f"C{k}"
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(totals > 0, np.asarray(counts) / totals, np.nan)
        t = shares["tenants"][name]
        ax.plot(
            mids, share, marker="o", ms=3, color=color, label=f"{name} (weight {t['weight']:g})"
        )
        ax.axhline(t["weight_share"], color=color, ls="--", lw=1)
    ax.axvspan(*report["raw"]["window_s"], color="grey", alpha=0.1, label="measured window")
    ax.set_xlabel("seconds since the flood started")
    ax.set_ylabel(f"share of output tokens per {shares['bucket_s']:g} s")
    ax.set_ylim(0, 1)
    ax.set_title("Token share of each weighted tenant (dashed: its weight's share)")
    ax.legend(loc="upper right", fontsize=8)
    paths = [save_figure(fig, stem.with_name(stem.name + "_share.png"), note=note)]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, (label, values) in enumerate(report["ttft_samples_s"].items()):
        if values:
            y = np.arange(1, len(values) + 1) / len(values)
            ax.step(values, y, where="post", color=f"C{k}", label=f"{label} (n={len(values)})")
    for priority, slo in report["slo"].items():
        ax.axvline(slo["ttft_s"], color="grey", ls=":", lw=1)
        ax.text(slo["ttft_s"], 0.02, f" P{priority} target", fontsize=7, color="grey")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT per priority class")
    ax.legend(loc="upper left", fontsize=8)
    paths.append(save_figure(fig, stem.with_name(stem.name + "_ttft_cdf.png"), note=note))
    return paths


def render_markdown(report: dict, plots: list[Path]) -> Markdown:
    f, shares, ttft = report["figures"], report["shares"], report["ttft"]
    config, window = report["config"], report["raw"]["window_s"]
    load = report["loadavg_1m_in_window"]
    slos = ", ".join(
        f"priority {p}: {s['ttft_s']:g} s / {s['timeout_s']:g} s" for p, s in report["slo"].items()
    )
    md = Markdown(f"loramux bench {report['preset']}")
    md.text(
        report["description"] + ".",
        f"Command: `{report['command']}`; model {report['model']}; settings "
        f"{report['settings']}; {config['streams']} streams per weighted tenant, window "
        f"{window[0]:g}-{window[1]:g} s after the flood started (warm-up {config['warmup']:g} s), "
        f"buckets of {config['bucket']:g} s, a priority request every "
        f"{config['probe_interval']:g} s. SLOs (TTFT target / deadline): {slos}.",
    )
    md.machine(
        report["machine"],
        note=f"1-minute load average {report['loadavg_before'][0]} before, "
        f"{report['loadavg_after'][0]} after; the server's process used "
        f"{report['raw']['clock']['cores_used']} cores on average over both phases "
        f"({report['machine']['nproc']} on the machine; the clients ran in a process of "
        "their own). 1-minute load average over the window: "
        + (
            f"mean {load['mean']}, max {load['max']} (this run's server and clients alone "
            "make about 2)."
            if load
            else "not sampled."
        ),
    )
    md.section("Verdicts").goals(report["goals"])
    tokens = sum(t["tokens"] for t in shares["tenants"].values())
    md.section(f"Share of output tokens over the window ({tokens} tokens)")
    md.table(
        (
            "tenant",
            "weight",
            "weight share",
            "tokens",
            "share",
            "share / weight share",
            f"over {shares['span_s']:g}-s spans (min-max)",
        ),
        [
            (
                n,
                f"{t['weight']:g}",
                num(t["weight_share"], 3),
                t["tokens"],
                num(t["share"], 3),
                num(t["ratio"], 3),
                f"{t['ratio_30s_min']}-{t['ratio_30s_max']}",
            )
            for n, t in shares["tenants"].items()
        ],
    )
    backlogged = ", ".join(
        f"{n} {e['backlogged_fraction']:.0%} (mean queued {e['mean_queued']})"
        for n, e in report["engine"].items()
        if e["backlogged_fraction"] is not None
    )
    md.text(
        "Backlogged (requests queued in the engine) in the engine's 1-s samples over the "
        f"window: {backlogged} of {report['engine_samples_in_window']} samples."
    )
    md.section("Time to first token (ms)")
    md.table(
        ("requests", "n", "median", "P99", "max"),
        [
            (name, s["n"], num(s["p50_ms"], 0), num(s["p99_ms"], 0), num(s["max_ms"], 0))
            for name, s in ttft.items()
        ],
    )
    md.text(
        f"Priority tenant under the flood / idle: median **{f['priority_ttft_p50_ratio']}x**, "
        f"P99 **{f['priority_ttft_p99_ratio']}x** (with {ttft['priority_flood']['n']} probes "
        "the P99 is about the worst one)."
    )
    md.section("SLO attainment (requests sent in the window)")
    md.table(
        ("class / tenant", "sent", "admitted", "met SLO", "attainment", "of admitted"),
        [
            (
                n,
                a["sent"],
                a["admitted"],
                a["met"],
                pct(a["attainment"], 1),
                pct(a["attainment_admitted"], 1),
            )
            for n, a in report["slo_attainment"].items()
        ],
    )
    md.section("Shed and expired (the whole run; client-seen / `/metrics`)")
    md.table(
        (
            "tenant",
            "429 queue_full",
            "503 deadline_unattainable",
            "expired queued",
            "expired generating",
            "other errors",
            "matches /metrics",
        ),
        [
            (
                n,
                *(f"{s['client'][k]} / {s['metrics'][k]}" for k in OUTCOMES),
                s["client"]["errors"],
                "yes" if s["matches"] else "NO",
            )
            for n, s in report["shed_expired"].items()
        ],
    )
    served = ", ".join(
        f"{n} {v['client']} / {v['metrics']}" for n, v in report["served_output_tokens"].items()
    )
    md.text(
        "Output tokens received by the clients / counted by the engine "
        "(`loramux_tenant_served_tokens_total`; it also counts tokens an expiring request "
        f"generated but never sent): {served}."
    )
    return md.plots(plots)


def write_results(stem: Path, report: dict, run: dict, slos: dict, goals) -> None:
    """The figures, the plots and the report (``<stem>.{json,md}``) of ``run``."""
    bucket = report["config"]["bucket"]
    report |= summarize(run, report["tenants"], slos, bucket, goals)
    report["raw"] = compact(run)
    stem.parent.mkdir(parents=True, exist_ok=True)
    write(stem, report, render_markdown(report, write_plots(report, stem)))
