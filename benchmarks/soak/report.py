"""The soak's report: the markdown and the plot (RSS and its fit, responses/s by class,
fds and threads, adapter versions against their bound, churn acts, over the same minutes)."""

from __future__ import annotations

from pathlib import Path

from loramux.benchmarks.common.files import pyplot, save_figure
from loramux.benchmarks.common.report import Markdown, mark, num
from loramux.benchmarks.soak.server import MIB
from loramux.benchmarks.soak.verdict import USAGE_FIELDS

FIGURES = {"rss_mib": "RSS (MiB)", "fds": "open fds", "threads": "threads"}
CHURN_COLORS = {"upload": "tab:green", "version": "tab:blue", "delete": "tab:red"}


def render_markdown(report: dict, plot_name: str) -> Markdown:
    c, m, v = report["config"], report["machine"], report["verdict"]
    loads = [s["load1"] for s in report["samples"]]
    md = Markdown("Soak: loramux serve under steady load with adapter churn")
    md.text(
        f"{m['date']}, {m['cpu_model']} ({m['nproc']} cores), {m['mem_total_gib']} GiB; "
        f"commit {report['code']['commit']} (working tree: {report['code']['changed_files']} "
        f"files changed or new); model `{Path(c['model']).name}`; server ready in "
        f"{report['server_start_s']} s. "
        f"{c['duration']:.0f} s of load: {c['concurrency']} clients at {c['rate']} requests/s "
        f"offered, a churn act every {c['churn_interval']} s, a sample every "
        f"{c['sample_interval']} s; host adapter tier bound (`LORAMUX_ADAPTER_HOST_BYTES`) "
        f"{c['adapter_host_bytes'] / MIB:.0f} MiB, everything else the embedded default.",
        "The soak is about growth and errors, not speed: the machine was shared with other "
        f"work (1-minute load average during the run {min(loads):.1f} to {max(loads):.1f} "
        f"on {m['nproc']} cores), so latencies and throughput are whatever was left.",
        f"**Verdict: {'passed' if v['passed'] else 'FAILED'}.**",
    )
    md.table(("check", "result"), [(name, mark(ok)) for name, ok in v["checks"].items()], "ll")
    for section in (_requests, _churn, _resources, _billing, _ending):
        section(md, report)
    md.command(c["command_line"])
    return md.lines(f"![RSS, responses/s, fds and threads, churn acts over the run]({plot_name})")


def _requests(md: Markdown, report: dict) -> None:
    counts, duration = report["counts"], report["config"]["duration"]
    statuses = sorted(counts["by_status"])
    by_kind = {**counts["by_kind"], "**all**": counts["by_status"]}
    failed = (counts["failures"] + counts["unexpected_4xx"])[:10]
    md.section("Requests").text(
        f"{counts['requests']} requests in {duration:.0f} s "
        f"({counts['requests'] / duration:.2f}/s achieved); by target: "
        + ", ".join(f"{k} {n}" for k, n in sorted(counts["by_target"].items()))
        + f". 404s for an adapter the churn deleted while the request was under way "
        f"(expected): {counts['expected_404']}; 5xx, transport and stream errors: "
        f"{len(counts['failures'])}; other 4xx: {len(counts['unexpected_4xx'])}."
    )
    md.table(
        ("kind", *statuses), [(k, *(n.get(s, 0) for s in statuses)) for k, n in by_kind.items()]
    )
    if failed:
        md.bullets(
            f"at {o['picked_s']:.1f} s: {o['kind']} on {o['tenant']}/{o['model']}: "
            f"{o['status']} {o['error']}"
            for o in failed
        )


def _churn(md: Markdown, report: dict) -> None:
    samples, v = report["samples"], report["verdict"]
    first, last = samples[0], samples[-1]
    acts = ", ".join(f"{k}: {n}" for k, n in sorted(report["counts"]["churn"].items()))
    tiers = ", ".join(f"{k} {n}" for k, n in sorted(last.get("adapters_by_tier", {}).items()))
    grew = v["registered_max"] > v["registered_bound"]
    md.section("Adapter churn").text(
        f"Acts (action status: count): {acts}. Over the run the engine loaded adapters "
        f"{num(last.get('adapter_loads', 0) - first.get('adapter_loads', 0), 0)} times and "
        f"evicted {num(last.get('adapter_evictions', 0) - first.get('adapter_evictions', 0), 0)} "
        f"(both tiers); the host tier held at most "
        f"{num(max(s.get('host_mib', 0) for s in samples))} MiB of its "
        f"{num(last.get('host_capacity_mib'), 0)} MiB bound. Adapter versions registered in "
        f"the engine: at most {v['registered_max']} (bound {v['registered_bound']}: the "
        "latest version of every adapter that can be live, plus one per client for a request "
        "still on an older one, plus those superseded within the platform's grace period), "
        f"{last.get('registered_adapters')} at the end ({tiers}; "
        "`store`: registered, resident nowhere)."
        + (
            " Above the bound, versions no request can reach any more (superseded by a new "
            "version) stay registered in the engine: they grow with the uploads."
            if grew
            else ""
        )
    )


def _resources(md: Markdown, report: dict) -> None:
    v, samples = report["verdict"], report["samples"]
    first, last = samples[0], samples[-1]
    rows = []
    for key, label in FIGURES.items():
        f, tolerance = v["fits"][key], v["tolerances"][key]
        if f is not None:
            levels = [num(x) for x in (first.get(key), f["first"], f["last"], f["min"], f["max"])]
            slopes = [f"{f['slope_per_min']:+.2f}", num(f["second_half_slope_per_min"], 2)]
            rise = f["fitted_rise"]
            verdict = [f"{rise:+.1f}", f"{tolerance:g}", mark(rise <= tolerance)]
            rows.append([label, *levels, *slopes, *verdict])
    rss = v["fits"]["rss_mib"]
    parts = ", ".join(f"{k} {x:.2f}" for k, x in last.get("data_dir_parts_mib", {}).items())
    md.section(f"Memory and resources (steady part: from {v['warmup_s']:.0f} s)")
    columns = "figure | at 0 s | steady start | end | min | max | slope /min | 2nd-half slope /min"
    md.table(
        (columns + " | fitted rise | tolerance | verdict").split(" | "), rows, "l" + "r" * 9 + "l"
    )
    md.text(
        f"Peak RSS (VmHWM) {num(last.get('hwm_mib'))} MiB. RSS scatter around the fit: "
        f"{num(rss and rss['residual_std'], 2)} MiB (std). Server CPU time "
        f"{num(last.get('cpu_s', 0) - first.get('cpu_s', 0), 0)} s over the load. Data dir "
        f"{num(first.get('data_dir_mib'), 2)} MiB at the start, {num(last.get('data_dir_mib'), 2)} "
        f"at the end ({parts} MiB): the database grows by one usage row per request (by "
        "design); the store is content-addressed and the churn re-uploads the same pool of "
        "adapters."
    )


def _billing(md: Markdown, report: dict) -> None:
    b = report["billing"]
    done, cut = b["completed"], b["dropped"]
    rows = [(f, f"{done['returned'][f]:,}", f"{done['billed'][f]:,}") for f in USAGE_FIELDS]
    dropped = f"dropped streams ({cut['requests']}): completion tokens received / billed"
    rows.append((dropped, f"{cut['tokens_received']:,}", f"{cut['tokens_billed']:,}"))
    md.section("Billing").text(
        f"`/admin/usage?group_by=request` against what the API returned: {b['requests_billed']} "
        f"requests billed, {b['requests_returned']} returned usage; "
        f"{b['mismatch_count']} requests differ, {len(b['billed_but_not_returned'])} billed "
        f"that no client saw; {b['requests_without_tokens']} delivered no token (a stream "
        "dropped after its first, empty chat chunk) and are not billed, as documented."
    )
    md.table((f"completed requests ({done['requests']})", "returned", "billed"), rows)


def _ending(md: Markdown, report: dict) -> None:
    end, db = report["ending"], report["database"]
    shutdown = end["shutdown"]
    graceful = "graceful (uvicorn finished, then re-raised the signal)"
    md.section("Shutdown and what is left").text(
        f"SIGTERM after the load: exit status {shutdown['exit_code']} after "
        f"{num(shutdown['seconds'], 2)} s, {graceful if shutdown['graceful'] else 'NOT graceful'}"
        f"{' (killed)' if shutdown['needed_kill'] else ''}. "
        f"Adapter versions by status: {db['versions_by_status']}; adapters live "
        f"{db['adapters_live']}, deleted {db['adapters_deleted']}; provisional usage rows "
        f"{db['provisional_usage_rows']}; left in tmp/uploads or TMPDIR: "
        f"{end['leftovers'] or 'nothing'}. Error lines in the server log: "
        f"{len(report['server_log_errors'])}; failed samples: {len(report['sample_errors'])}."
    )


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
    _plot_memory(axes[0], samples, verdict["fits"]["rss_mib"])
    _plot_rates(axes[1], report["rate_bins"], report["config"]["rate"])
    # fds and threads; adapter versions registered in the engine against their bound, and
    # those resident in host RAM and on the device (on an axis of their own: fds share none).
    lines = (("fds", "tab:purple", "open fds"), ("threads", "tab:brown", "threads"))
    _plot_lines(axes[2], samples, lines, "fds, threads", max(s.get("fds", 0) for s in samples))
    bound = verdict["registered_bound"]
    axes[3].axhline(bound, color="tab:cyan", linestyle=":", label=f"registration bound ({bound})")
    lines = (
        ("registered_adapters", "tab:cyan", "registered"),
        ("host_adapters", "tab:orange", "in host RAM"),
        ("device_adapters", "tab:green", "on device"),
    )
    top = max([bound, *(s.get("registered_adapters", 0) for s in samples)])
    _plot_lines(axes[3], samples, lines, "adapter versions", top)
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


def _plot_memory(ax, samples: list[dict], fit_rss: dict | None) -> None:
    """RSS and the fit; the y axis zooms on the steady level, the start (model loaded,
    nothing served yet) is written in the corner; the host tier on its own axis."""
    t, rss_mib = _series(samples, "rss_mib")
    ax.plot(t, rss_mib, color="tab:blue", marker=".", label="server RSS")
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


def _plot_lines(ax, samples: list[dict], lines, ylabel: str, top: float) -> None:
    """Each (key, color, label) of ``lines`` over the run; 40 % headroom for the legend."""
    for key, color, label in lines:
        ax.plot(*_series(samples, key), color=color, marker=".", label=label)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, top * 1.4)
    ax.legend(loc="upper left", fontsize=8, ncol=4)


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
