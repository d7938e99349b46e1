"""``loramux bench``'s figures, plots and markdown, shared by the CPU and GPU runners.

``figures`` turns a driver's records into ``measures.summarize``'s dict plus the latency
samples the plots need; a run's duration is its last request's finish time on the
driver's clock (zero when the timed run starts, after model loading and warm-up), the
same rule for every system. ``write_plots`` draws latency CDFs and per-tenant shares
(none, with a note, where matplotlib is missing); ``markdown`` the summary table, the
ratios, a GPU run's model, memory, references and goals, and the sweeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from loramux.benchmarks.common.files import pyplot, save_figure
from loramux.benchmarks.common.measures import RequestRecord, summarize
from loramux.benchmarks.common.report import DASH, Markdown, ms, num, pct
from loramux.benchmarks.common.workload import WorkloadSpec
from loramux.benchmarks.serve.presets import Preset

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

METRIC_UNITS = {"requests_per_s": "req/s", "output_tokens_per_s": "output tok/s"}


def _latency_row(labels: list, f: dict) -> list:
    ttft, itl, e2e = f["ttft_s"], f["itl_s"], f["e2e_s"]
    return [
        *labels,
        num(f["requests_per_s"], 2),
        num(f["output_tokens_per_s"]),
        f"{ms(ttft['p50'])} / {ms(ttft['p99'])}",
        f"{ms(itl['p50'])} / {ms(itl['p99'])}",
        f"{ms(e2e['p50'])} / {ms(e2e['p99'])}",
        pct(f.get("slo_attainment")),
        f["requests"]["failed"],
    ]


def _gib(value: int | None) -> str:
    if value is None:
        return DASH
    return f"{value / 2**30:.1f} GiB" if value >= 2**30 else f"{value / 2**20:.0f} MiB"


def _gpu_parts(doc: Markdown, report: dict) -> None:
    """Model, engine, baseline, agreement, memory, references and goals of a GPU run."""
    model, engine, baseline = report["model"], report["engine_config"], report["baseline"]
    agree = report["agreement"]
    doc.text(
        f"Model: {model['shape']} from config.json, random weights (load_format=random, seed "
        f"{model['seed']}, N(0, {model['weight_std']}²), norms 1), {model['dtype']}, on "
        f"{model['device']}. Adapters: {report['adapters']['source']}.",
        f"Engine: kv_cache_bytes {_gib(engine['kv_cache_bytes'])} (KV and resident adapters), "
        f"adapter_host_bytes {_gib(engine['adapter_host_bytes'])}, "
        f"{engine['adapter_load_workers']} loader threads, max_num_seqs "
        f"{engine['max_num_seqs']}, max_num_batched_tokens {engine['max_num_batched_tokens']}.",
        baseline and f"Baseline: {baseline['policy']}.",
        agree
        and f"Greedy agreement (same weights in both): {agree['identical_requests']}/"
        f"{agree['requests']} requests with identical tokens.",
        f"Peak GPU memory: loramux {_gib(report['loramux']['peak_gpu_bytes'])}"
        + ("" if baseline is None else f", baseline {_gib(baseline['peak_gpu_bytes'])}")
        + ".",
    )
    if report["references"]:
        rows = []
        for ref in report["references"]:
            unit = METRIC_UNITS.get(ref["metric"], ref["metric"])
            rows.append(
                (
                    ref["system"],
                    ref["setting"],
                    f"{ref['value']:g} {unit}",
                    f"{ref['loramux']:.2f} {unit}",
                    f"{ref['ratio']:.2f}x",
                )
            )
        columns = ("published", "setting", "figure", "loramux (this run)", "loramux / published")
        doc.table(columns, rows, "llrrr")
    for goal in report["goals"]:
        unit = METRIC_UNITS.get(goal["metric"], goal["metric"])
        why = f" ({goal['why']})" if goal["why"] else ""
        doc.text(
            f"**Goal: loramux {unit} {goal['relation']} {goal['value']:g}{why}: measured "
            f"{goal['measured']:.2f}, {goal['verdict']}.**"
        )


def markdown(report: dict, plots: Sequence[Path]) -> Markdown:
    """Both systems' table, the ratios, a GPU run's parts, the machine, the sweeps."""
    ratio, loramux = report["ratios"], report["loramux"]
    doc = Markdown(f"loramux bench {report['preset']}").text(report["description"] + ".")
    systems = [(f"loramux ({loramux.get('driver', 'engine')})", loramux)]
    systems += [("transformers + PEFT", report["baseline"])] if report["baseline"] else []
    doc.table(
        ("system", *LATENCY_COLUMNS),
        [_latency_row([label], f) for label, f in systems],
    )
    if ratio.get("output_tokens_per_s") is not None:
        doc.text(
            f"**loramux / transformers + PEFT: {ratio['output_tokens_per_s']:.2f}x output "
            f"tokens/s, {ratio['requests_per_s']:.2f}x requests/s** "
            f"({report.get('ratio_note', 'same workload, same run')})."
        )
    tenants = loramux.get("tenants") or {}
    if len(tenants) > 1:
        shares = ", ".join(
            f"{name} {t['share']:.0%} of tokens (weight {t['weight_share']:.0%})"
            for name, t in sorted(tenants.items())
        )
        doc.text(f"Per-tenant share on loramux: {shares}.")
    if "model" in report:
        _gpu_parts(doc, report)
    libraries = ("torch", "transformers", "peft")
    doc.machine(report["machine"], libraries, note=f"GPU figures: {report['gpu_figures']}.")
    doc.plots(plots)
    for kind, sweep in (report.get("sweeps") or {}).items():
        doc.section(f"Sweep: {kind} (loramux, {sweep['driver']} driver)")
        rows = [
            _latency_row([p["num_adapters"], f"{p['offered_rate']:.2f}"], p["figures"])
            for p in sweep["points"]
        ]
        doc.table(("adapters", "offered req/s", *LATENCY_COLUMNS), rows, "r")
    return doc


LATENCY_COLUMNS = (
    "req/s",
    "output tok/s",
    "TTFT P50 / P99 ms",
    "ITL P50 / P99 ms",
    "E2E P50 / P99 ms",
    "SLO attainment",
    "failed",
)
