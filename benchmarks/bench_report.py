"""``loramux bench``'s figures, plots and markdown, shared by the CPU and GPU runners.

``figures`` turns a driver's records into ``measures.summarize``'s dict plus the latency
samples the plots need; a run's duration is its last request's finish time on the
driver's clock (zero when the timed run starts, after model loading and warm-up), the
same rule for every system. ``write_plots`` draws latency CDFs and per-tenant shares
(none, with a note, where matplotlib is missing); ``render_markdown`` the summary table,
the ratios, and whatever lines a runner adds.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from loramux.benchmarks import bench_sweeps
from loramux.benchmarks.bench_presets import Preset
from loramux.benchmarks.common.files import pyplot, save_figure
from loramux.benchmarks.common.machine import machine_text
from loramux.benchmarks.common.measures import RequestRecord, summarize
from loramux.benchmarks.common.workload import WorkloadSpec

CDF_POINTS = 2001  # latency samples kept per kind in the report (quantiles beyond that)


def tenant_weights(spec: WorkloadSpec) -> dict[str, float]:
    return {t.name: t.weight for t in spec.tenants}


def run_duration(records: Sequence[RequestRecord]) -> float:
    """Seconds from the timed run's start to its last request's end."""
    last = max((r.finish_s for r in records if r.finish_s is not None), default=0.0)
    return max(last, 1e-9)


def figures(records: Sequence[RequestRecord], preset: Preset, spec: WorkloadSpec) -> dict:
    """``summarize``'s figures of ``records`` plus their latency samples."""
    summary = summarize(
        records,
        duration_s=run_duration(records),
        slo_ttft_s=preset.slo_ttft_s,
        slo_itl_s=preset.slo_itl_s,
        tenant_weights=tenant_weights(spec),
    )
    served = [r for r in records if r.ok]
    samples = {
        "ttft_s": [r.ttft_s for r in served if r.ttft_s is not None],
        "itl_s": [gap for r in served for gap in r.itls_s],
        "e2e_s": [r.e2e_s for r in served if r.e2e_s is not None],
    }
    summary["sample_counts"] = {key: len(values) for key, values in samples.items()}
    summary["samples"] = {key: cdf_points(values) for key, values in samples.items()}
    return summary


def cdf_points(values: Sequence[float], limit: int = CDF_POINTS) -> list[float]:
    """``values`` sorted, or ``limit`` evenly spaced quantiles of them (min and max kept):
    enough for a CDF plot, small enough for the JSON of a 2,000-request run."""
    ordered = sorted(values)
    if len(ordered) <= limit:
        return ordered
    last = len(ordered) - 1
    return [ordered[round(k * last / (limit - 1))] for k in range(limit)]


def ratios(loramux: dict, baseline: dict | None) -> dict:
    """loramux's throughput over the baseline's (empty without a baseline)."""
    if baseline is None:
        return {}

    def ratio(key: str) -> float | None:
        a, b = loramux.get(key), baseline.get(key)
        return None if not a or not b else a / b

    return {
        "output_tokens_per_s": ratio("output_tokens_per_s"),
        "requests_per_s": ratio("requests_per_s"),
    }


# --- plots ------------------------------------------------------------------------------------


def write_plots(report: dict, stem: Path) -> list[Path]:
    """Latency CDFs of both systems, and each tenant's token share against its weight."""
    plt = pyplot()
    if plt is None:
        return []
    systems = {"loramux": report["loramux"], "transformers + PEFT": report["baseline"]}
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, title) in zip(
        axes,
        (
            ("ttft_s", "time to first token"),
            ("itl_s", "inter-token latency"),
            ("e2e_s", "end to end"),
        ),
        strict=True,
    ):
        for label, figures_of in systems.items():
            if not figures_of:
                continue
            values = sorted(figures_of["samples"][key])
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=label)
        ax.set_title(title)
        ax.set_xlabel("seconds")
        ax.set_ylabel("fraction of requests" if key != "itl_s" else "fraction of gaps")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{report['preset']}: latency CDFs")
    paths.append(save_figure(fig, stem.with_name(stem.name + "_latency_cdf.png")))

    shares = report["loramux"].get("tenants") or {}
    if shares:
        fig, ax = plt.subplots(figsize=(6, 4))
        names = sorted(shares)
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [shares[n]["share"] for n in names], 0.4, label="tokens")
        ax.bar(
            [x + 0.2 for x in xs], [shares[n]["weight_share"] for n in names], 0.4, label="weight"
        )
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("share")
        ax.set_title(f"{report['preset']}: loramux token share per tenant")
        ax.legend()
        paths.append(save_figure(fig, stem.with_name(stem.name + "_tenant_share.png")))
    return paths


# --- markdown ---------------------------------------------------------------------------------


def _ms(value) -> str:
    return "—" if value is None else f"{value * 1000:.0f}"


def _table(report: dict) -> list[str]:
    rows = [
        "| system | req/s | output tok/s | TTFT P50 / P99 ms | ITL P50 / P99 ms "
        "| E2E P50 / P99 ms | SLO attainment | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, figures_of in (
        (f"loramux ({report['loramux'].get('driver', 'engine')})", report["loramux"]),
        ("transformers + PEFT", report["baseline"]),
    ):
        if not figures_of:
            continue
        ttft, itl, e2e = figures_of["ttft_s"], figures_of["itl_s"], figures_of["e2e_s"]
        slo = figures_of.get("slo_attainment")
        rows.append(
            f"| {label} | {figures_of['requests_per_s']:.2f} "
            f"| {figures_of['output_tokens_per_s']:.1f} "
            f"| {_ms(ttft['p50'])} / {_ms(ttft['p99'])} | {_ms(itl['p50'])} / {_ms(itl['p99'])} "
            f"| {_ms(e2e['p50'])} / {_ms(e2e['p99'])} "
            f"| {'—' if slo is None else f'{slo:.0%}'} | {figures_of['requests']['failed']} |"
        )
    return rows


def _machine_line(report: dict) -> str:
    libraries = ("torch", "transformers", "peft")
    return f"{machine_text(report['machine'], libraries)} GPU figures: {report['gpu_figures']}."


def render_markdown(report: dict, plots: list[Path], extra: Sequence[str] = ()) -> str:
    """The summary: the table of both systems, the ratios, ``extra`` lines, the machine."""
    ratio = report["ratios"]
    lines = [f"# loramux bench {report['preset']}", "", report["description"] + ".", ""]
    lines += [*_table(report), ""]
    if ratio.get("output_tokens_per_s") is not None:
        lines.append(
            f"**loramux / transformers + PEFT: {ratio['output_tokens_per_s']:.2f}x output "
            f"tokens/s, {ratio['requests_per_s']:.2f}x requests/s** "
            f"({report.get('ratio_note', 'same workload, same run')})."
        )
    tenants = report["loramux"].get("tenants") or {}
    if len(tenants) > 1:
        shares = ", ".join(
            f"{name} {t['share']:.0%} of tokens (weight {t['weight_share']:.0%})"
            for name, t in sorted(tenants.items())
        )
        lines += ["", f"Per-tenant share on loramux: {shares}."]
    if extra:
        lines += ["", *extra]
    lines += [
        "",
        _machine_line(report),
        "",
        "Plots: " + (", ".join(p.name for p in plots) or "none (matplotlib is not installed)"),
    ]
    for kind, sweep in (report.get("sweeps") or {}).items():
        lines += ["", *bench_sweeps.render_markdown(kind, sweep)]
    return "\n".join(lines) + "\n"
