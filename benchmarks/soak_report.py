"""The soak's report: the markdown and the plot (RSS and its fit, responses/s by class,
fds and threads, adapter versions against their bound, churn acts, over the same minutes)."""

from __future__ import annotations

from pathlib import Path

from loramux.benchmarks.common.files import pyplot, save_figure
from loramux.benchmarks.soak_server import MIB
from loramux.benchmarks.soak_verdict import USAGE_FIELDS


def _mark(ok: bool) -> str:
    return "ok" if ok else "**FAILED**"


def _fmt(value, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _table(header: str, rows: list[list]) -> list[str]:
    """A markdown table; ``header`` is its cells joined by " | "."""
    return [
        f"| {header} |",
        "|" + "---|" * (header.count(" | ") + 1),
        *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows),
    ]


def render_markdown(report: dict, plot_name: str) -> str:
    parts = (_md_header, _md_requests, _md_churn, _md_resources, _md_billing, _md_ending)
    plot = f"![RSS, responses/s, fds and threads, churn acts over the run]({plot_name})"
    sections = [*(part(report) for part in parts), [plot, ""]]
    return "\n".join(line for section in sections for line in section)


def _md_header(report: dict) -> list[str]:
    c, m, v = report["config"], report["machine"], report["verdict"]
    loads = [s["load1"] for s in report["samples"]]
    return [
        "# Soak: loramux serve under steady load with adapter churn",
        "",
        f"{m['date']}, {m['cpu_model']} ({m['nproc']} cores), {m['mem_total_gib']} GiB; "
        f"commit {report['code']['commit']} (working tree: {report['code']['changed_files']} "
        f"files changed or new); model `{Path(c['model']).name}`; server ready in "
        f"{report['server_start_s']} s. "
        f"{c['duration']:.0f} s of load: {c['concurrency']} clients at {c['rate']} requests/s "
        f"offered, a churn act every {c['churn_interval']} s, a sample every "
        f"{c['sample_interval']} s; host adapter tier bound (`LORAMUX_ADAPTER_HOST_BYTES`) "
        f"{c['adapter_host_bytes'] / MIB:.0f} MiB, everything else the embedded default.",
        "",
        "The soak is about growth and errors, not speed: the machine was shared with other "
        f"work (1-minute load average during the run {min(loads):.1f} to {max(loads):.1f} "
        f"on {m['nproc']} cores), so latencies and throughput are whatever was left.",
        "",
        f"**Verdict: {'passed' if v['passed'] else 'FAILED'}.**",
        "",
        *_table("check | result", [[name, _mark(ok)] for name, ok in v["checks"].items()]),
        "",
    ]


def _md_requests(report: dict) -> list[str]:
    counts, c = report["counts"], report["config"]
    statuses = sorted(counts["by_status"])
    by_kind = {**counts["by_kind"], "**all**": counts["by_status"]}
    rows = [[kind, *(n.get(s, 0) for s in statuses)] for kind, n in by_kind.items()]
    failed = (counts["failures"] + counts["unexpected_4xx"])[:10]
    return [
        "## Requests",
        "",
        f"{counts['requests']} requests in {c['duration']:.0f} s "
        f"({counts['requests'] / c['duration']:.2f}/s achieved); by target: "
        + ", ".join(f"{k} {n}" for k, n in sorted(counts["by_target"].items()))
        + f". 404s for an adapter the churn deleted while the request was under way "
        f"(expected): {counts['expected_404']}; 5xx, transport and stream errors: "
        f"{len(counts['failures'])}; other 4xx: {len(counts['unexpected_4xx'])}.",
        "",
        *_table(" | ".join(["kind", *statuses]), rows),
        *(
            f"- at {o['picked_s']:.1f} s: {o['kind']} on {o['tenant']}/{o['model']}: "
            f"{o['status']} {o['error']}"
            for o in failed
        ),
        "",
    ]


def _md_churn(report: dict) -> list[str]:
    samples, v = report["samples"], report["verdict"]
    first, last = samples[0], samples[-1]
    acts = ", ".join(f"{k}: {n}" for k, n in sorted(report["counts"]["churn"].items()))
    tiers = ", ".join(f"{k} {n}" for k, n in sorted(last.get("adapters_by_tier", {}).items()))
    return [
        "## Adapter churn",
        "",
        f"Acts (action status: count): {acts}. Over the run the engine loaded adapters "
        f"{_fmt(last.get('adapter_loads', 0) - first.get('adapter_loads', 0), 0)} times and "
        f"evicted {_fmt(last.get('adapter_evictions', 0) - first.get('adapter_evictions', 0), 0)} "
        f"(both tiers); the host tier held at most "
        f"{_fmt(max(s.get('host_mib', 0) for s in samples))} MiB of its "
        f"{_fmt(last.get('host_capacity_mib'), 0)} MiB bound. Adapter versions registered in "
        f"the engine: at most {v['registered_max']} (bound {v['registered_bound']}: the "
        "latest version of every adapter that can be live, plus one per client for a request "
        "still on an older one, plus those superseded within the platform's grace period), "
        f"{last.get('registered_adapters')} at the end ({tiers}; "
        "`store`: registered, resident nowhere)."
        + (
            " Above the bound, versions no request can reach any more (superseded by a new "
            "version) stay registered in the engine: they grow with the uploads."
            if v["registered_max"] > v["registered_bound"]
            else ""
        ),
        "",
    ]


def _md_resources(report: dict) -> list[str]:
    v, samples = report["verdict"], report["samples"]
    first, last = samples[0], samples[-1]
    rows = []
    for key, label in (("rss_mib", "RSS (MiB)"), ("fds", "open fds"), ("threads", "threads")):
        f, tolerance = v["fits"][key], v["tolerances"][key]
        if f is None:
            continue
        levels = [_fmt(x) for x in (first.get(key), f["first"], f["last"], f["min"], f["max"])]
        slopes = [f"{f['slope_per_min']:+.2f}", _fmt(f["second_half_slope_per_min"], 2)]
        rise = f["fitted_rise"]
        rows.append(
            [label, *levels, *slopes, f"{rise:+.1f}", f"{tolerance:g}", _mark(rise <= tolerance)]
        )
    rss = v["fits"]["rss_mib"]
    parts = last.get("data_dir_parts_mib", {})
    return [
        f"## Memory and resources (steady part: from {v['warmup_s']:.0f} s)",
        "",
        *_table(
            "figure | at 0 s | steady start | end | min | max | slope /min | 2nd-half slope /min "
            "| fitted rise | tolerance | verdict",
            rows,
        ),
        "",
        f"Peak RSS (VmHWM) {_fmt(last.get('hwm_mib'))} MiB. RSS scatter around the fit: "
        f"{_fmt(rss and rss['residual_std'], 2)} MiB (std). Server CPU time "
        f"{_fmt(last.get('cpu_s', 0) - first.get('cpu_s', 0), 0)} s over the load. Data dir "
        f"{_fmt(first.get('data_dir_mib'), 2)} MiB at the start, {_fmt(last.get('data_dir_mib'), 2)} "
        "at the end (" + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()) + " MiB): the "
        "database grows by one usage row per request (by design); the store is "
        "content-addressed and the churn re-uploads the same pool of adapters.",
        "",
    ]


def _md_billing(report: dict) -> list[str]:
    b = report["billing"]
    done, cut = b["completed"], b["dropped"]
    rows = [[f, f"{done['returned'][f]:,}", f"{done['billed'][f]:,}"] for f in USAGE_FIELDS]
    dropped = f"dropped streams ({cut['requests']}): completion tokens received / billed"
    rows.append([dropped, f"{cut['tokens_received']:,}", f"{cut['tokens_billed']:,}"])
    return [
        "## Billing",
        "",
        f"`/admin/usage?group_by=request` against what the API returned: {b['requests_billed']} "
        f"requests billed, {b['requests_returned']} returned usage; "
        f"{b['mismatch_count']} requests differ, {len(b['billed_but_not_returned'])} billed "
        f"that no client saw; {b['requests_without_tokens']} delivered no token (a stream "
        "dropped after its first, empty chat chunk) and are not billed, as documented.",
        "",
        *_table(f"completed requests ({done['requests']}) | returned | billed", rows),
        "",
    ]


def _md_ending(report: dict) -> list[str]:
    end, db = report["ending"], report["database"]
    shutdown = end["shutdown"]
    return [
        "## Shutdown and what is left",
        "",
        f"SIGTERM after the load: exit status {shutdown['exit_code']} after "
        f"{_fmt(shutdown['seconds'], 2)} s, "
        f"{'graceful (uvicorn finished, then re-raised the signal)' if shutdown['graceful'] else 'NOT graceful'}"
        f"{' (killed)' if shutdown['needed_kill'] else ''}. "
        f"Adapter versions by status: {db['versions_by_status']}; adapters live "
        f"{db['adapters_live']}, deleted {db['adapters_deleted']}; provisional usage rows "
        f"{db['provisional_usage_rows']}; left in tmp/uploads or TMPDIR: "
        f"{end['leftovers'] or 'nothing'}. Error lines in the server log: "
        f"{len(report['server_log_errors'])}; failed samples: {len(report['sample_errors'])}.",
        "",
    ]


def _series(samples: list[dict], key: str) -> tuple[list[float], list[float]]:
    points = [(s["t_s"] / 60, s[key]) for s in samples if s.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def write_plot(report: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    samples, verdict = report["samples"], report["verdict"]
    fig, axes = plt.subplots(
        5, 1, figsize=(11, 13), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.5, 1.5, 1]}
    )
    _plot_memory(axes[0], samples, verdict)
    _plot_rates(axes[1], report["rate_bins"], report["config"]["rate"])
    _plot_resources(axes[2], samples)
    _plot_adapters(axes[3], samples, verdict["registered_bound"])
    _plot_churn(axes[4], report["churn_events"])
    for ax in axes:
        ax.axvspan(0, verdict["warmup_s"] / 60, color="0.92", zorder=0)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes since the load started (grey: warm-up, left out of the fits)")
    status = "passed" if verdict["passed"] else "FAILED"
    fig.suptitle(
        f"loramux serve soak: {report['config']['duration'] / 60:.1f} min, "
        f"{report['counts']['requests']} requests, {len(report['churn_events'])} churn acts "
        f"({status})"
    )
    save_figure(fig, path, dpi=100)


def _plot_memory(ax, samples: list[dict], verdict: dict) -> None:
    """RSS and the fit; the y axis zooms on the steady level, the start (model loaded,
    nothing served yet) is written in the corner; the host tier on its own axis."""
    t, rss_mib = _series(samples, "rss_mib")
    ax.plot(t, rss_mib, color="tab:blue", marker=".", label="server RSS")
    fit_rss = verdict["fits"]["rss_mib"]
    if fit_rss is not None:
        slope = fit_rss["slope_per_min"]
        ends = [fit_rss["from_s"] / 60, fit_rss["to_s"] / 60]
        fitted = [fit_rss["intercept"] + slope * m for m in ends]
        label = f"fit after warm-up: {slope:+.2f} MiB/min"
        ax.plot(ends, fitted, color="black", linestyle="--", label=label)
        ax.set_ylim(fit_rss["min"] - 80, max(rss_mib) + 40)
        start = f"at 0 s: {rss_mib[0]:,.0f} MiB (before the first request)"
        ax.text(0.01, 0.03, start, transform=ax.transAxes, fontsize=8)
    ax.set_ylabel("RSS (MiB)")
    host = ax.twinx()
    host.step(*_series(samples, "host_mib"), where="post", color="tab:orange", alpha=0.5, lw=1)
    host.plot(*_series(samples, "host_capacity_mib"), color="tab:orange", linestyle=":")
    host.set_ylabel("host adapter tier (MiB; dotted: its bound)", color="tab:orange")
    host.set_ylim(0, 4 * max(s.get("host_capacity_mib", 1) for s in samples))  # lower quarter
    ax.legend(loc="upper left", fontsize=8)


def _plot_rates(ax, bins: list[dict], offered: float) -> None:
    t = [b["t_s"] / 60 for b in bins]
    width = (t[1] - t[0]) * 0.9 if len(t) > 1 else 0.1
    bottom = [0.0] * len(bins)
    for cls, color in (("ok", "tab:green"), ("4xx", "tab:olive"), ("failed", "tab:red")):
        values = [b.get(cls, 0.0) for b in bins]
        ax.bar(t, values, width=width, bottom=bottom, color=color, label=cls)
        bottom = [a + b for a, b in zip(bottom, values, strict=True)]
    ax.axhline(offered, color="0.4", linestyle=":", label=f"offered {offered}/s")
    ax.set_ylabel("responses/s")
    ax.legend(loc="lower right", fontsize=8, ncol=4)


def _plot_resources(ax, samples: list[dict]) -> None:
    ax.plot(*_series(samples, "fds"), color="tab:purple", marker=".", label="open fds")
    ax.plot(*_series(samples, "threads"), color="tab:brown", marker=".", label="threads")
    ax.set_ylabel("fds, threads")
    ax.set_ylim(0, max(s.get("fds", 0) for s in samples) * 1.4)  # headroom for the legend
    ax.legend(loc="upper left", fontsize=8, ncol=2)


def _plot_adapters(ax, samples: list[dict], bound: int) -> None:
    """Adapter versions registered in the engine against their bound, and those resident
    in host RAM and on the device (on an axis of their own: fds share none of it)."""
    ax.plot(*_series(samples, "registered_adapters"), color="tab:cyan", label="registered")
    ax.plot(*_series(samples, "host_adapters"), color="tab:orange", label="in host RAM")
    ax.plot(*_series(samples, "device_adapters"), color="tab:green", label="on device")
    ax.axhline(bound, color="tab:cyan", linestyle=":", label=f"registration bound ({bound})")
    ax.set_ylabel("adapter versions")
    top = max([bound, *(s.get("registered_adapters", 0) for s in samples)])
    ax.set_ylim(0, top * 1.4)  # headroom for the legend
    ax.legend(loc="upper left", fontsize=8, ncol=4)


CHURN_COLORS = {"upload": "tab:green", "version": "tab:blue", "delete": "tab:red"}


def _plot_churn(ax, events: list[dict]) -> None:
    actions = list(CHURN_COLORS)
    ax.eventplot(
        [[e["started_s"] / 60 for e in events if e["action"] == a] for a in actions],
        colors=list(CHURN_COLORS.values()),
        lineoffsets=range(len(actions)),
        linelengths=0.8,
    )
    ax.set_yticks(range(len(actions)), ["new adapter", "new version", "delete"])
    ax.set_ylabel("churn")
