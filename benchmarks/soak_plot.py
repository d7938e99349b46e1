"""The soak's plot: RSS with its fit, responses/s by class, fds and threads, adapter
versions in the engine against their bound, and the churn acts, over the same minutes.

Part of the soak (``soak.py``).
"""

from __future__ import annotations

from pathlib import Path

from loramux.benchmarks.bench_sweeps import pyplot


def _series(samples: list[dict], key: str) -> tuple[list[float], list[float]]:
    points = [(s["t_s"] / 60, s[key]) for s in samples if s.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def write_plot(report: dict, path: Path) -> None:
    """RSS (with the fit and the warm-up), requests/s by class, fds and threads, adapter
    versions in the engine, and the churn acts, over the same minutes."""
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
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_memory(ax, samples: list[dict], verdict: dict) -> None:
    """RSS and the fit; the y axis zooms on the steady level, the start (model loaded,
    nothing served yet) is written in the corner; the host tier on its own axis."""
    t, rss_mib = _series(samples, "rss_mib")
    ax.plot(t, rss_mib, color="tab:blue", marker=".", label="server RSS")
    fit_rss = verdict["fits"]["rss_mib"]
    if fit_rss is not None:
        slope = fit_rss["slope_per_min"]
        ends = [fit_rss["from_s"] / 60, fit_rss["to_s"] / 60]
        ax.plot(
            ends,
            [fit_rss["intercept"] + fit_rss["slope_per_min"] * m for m in ends],
            color="black",
            linestyle="--",
            label=f"fit after warm-up: {slope:+.2f} MiB/min",
        )
        ax.set_ylim(fit_rss["min"] - 80, max(rss_mib) + 40)
        ax.text(
            0.01,
            0.03,
            f"at 0 s: {rss_mib[0]:,.0f} MiB (before the first request)",
            transform=ax.transAxes,
            fontsize=8,
        )
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
