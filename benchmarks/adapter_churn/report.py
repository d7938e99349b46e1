"""``loramux bench adapter-churn``'s figures and markdown.

``figures`` reduces the runs of a kind (churn or all resident; samples joined, counters
summed) to its report entry: ITL, TTFT and queue time from the driver's records as
percentiles in milliseconds, step wall times by kind, and the engine's adapter traffic.
"""

from __future__ import annotations

from collections import Counter

from loramux.benchmarks.common.measures import percentiles
from loramux.benchmarks.common.report import Markdown


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


def distribution(values: list[float]) -> dict:
    """P50/P90/P99/max/mean in milliseconds, and the sample count."""
    p = percentiles(values, (50, 90, 99, 100))
    return {
        "p50_ms": _ms(p["p50"]),
        "p90_ms": _ms(p["p90"]),
        "p99_ms": _ms(p["p99"]),
        "max_ms": _ms(p["p100"]),
        "mean_ms": _ms(sum(values) / len(values)) if values else None,
        "samples": len(values),
    }


def figures(kind: str, runs: list[dict], max_tokens: int) -> dict:
    """A kind's figures from one or more of its runs (``runner.run_once``'s)."""
    records = [r for run in runs for r in run["records"]]
    served = [r for r in records if r.ok]
    steps = [s for run in runs for s in run["steps"]]
    counters = sum((Counter(run["counters"]) for run in runs), Counter())
    tokens = sum(r.output_tokens for r in records)
    seconds = sum(max(r.finish_s or 0.0 for r in run["records"]) for run in runs)
    clocks = [run["clock"] for run in runs]
    return {
        "mode": kind,
        "runs": len(runs),
        "requests": len(records),
        "failed_or_short": sum(not r.ok or r.output_tokens != max_tokens for r in records),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 2),
        "itl": distribution([gap for r in served for gap in r.itls_s]),
        "ttft": distribution([r.ttft_s for r in served if r.ttft_s is not None]),
        "queue": distribution([r.scheduled_s - r.arrival_s for r in served if r.scheduled_s]),
        "steps": {
            "count": len(steps),
            "mean_batch": round(sum(s.tokens for s in steps) / len(steps), 2) if steps else None,
            "all": distribution([s.seconds for s in steps]),
            "decode_only": distribution([s.seconds for s in steps if not s.first_tokens]),
            "with_prefill": distribution([s.seconds for s in steps if s.first_tokens]),
            "with_device_load": distribution([s.seconds for s in steps if s.device_loads]),
            "device_loads": sum(s.device_loads for s in steps),
        },
        "lora_forms": dict(sum((run["lora_forms"] for run in runs), Counter())),
        "adapters": _adapter_figures(counters),
        "used_adapters_on_device_before_trace": min(
            run["used_adapters_on_device_before_trace"] for run in runs
        ),
        "preemptions": int(counters["preemptions"]),
        "max_arrival_lag_ms": _ms(max(r.sent_s - r.arrival_s for r in records if r.sent_s)),
        "cores_used": min(c["cores_used"] for c in clocks),
        "cpu_seconds": round(sum(c["cpu_seconds"] for c in clocks), 2),
        "loadavg_1m_max": max(max(c["loadavg_1m_before"], c["loadavg_1m_after"]) for c in clocks),
    }


def _adapter_figures(c: Counter) -> dict:
    """Each tier's hits, misses and hit rate; loads, evictions, the mean load time."""
    out = {}
    for tier in ("device", "host"):
        hits, misses = c[f"{tier}_hits"], c[f"{tier}_misses"]
        out[f"{tier}_hits"], out[f"{tier}_misses"] = int(hits), int(misses)
        out[f"{tier}_hit_rate"] = round(hits / (hits + misses), 4) if hits + misses else None
    out.update({k: int(c[k]) for k in ("loads", "device_evictions", "host_evictions")})
    count = c["load_seconds_count"]
    out["load_ms_mean"] = _ms(c["load_seconds_sum"] / count) if count else None
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 4)


def repeat_figures(churn: dict, resident: dict) -> dict:
    """ITL P50 / P99 of both kinds, their ratios and cores used."""
    return {
        "churn_itl_p50_ms": churn["itl"]["p50_ms"],
        "churn_itl_p99_ms": churn["itl"]["p99_ms"],
        "resident_itl_p50_ms": resident["itl"]["p50_ms"],
        "resident_itl_p99_ms": resident["itl"]["p99_ms"],
        "ratio_itl_p99": _ratio(churn["itl"]["p99_ms"], resident["itl"]["p99_ms"]),
        "ratio_itl_p50": _ratio(churn["itl"]["p50_ms"], resident["itl"]["p50_ms"]),
        "churn_cores_used": churn["cores_used"],
        "resident_cores_used": resident["cores_used"],
    }


def _mib(nbytes: int) -> str:
    mib = nbytes / 1024**2
    return f"{mib:.0f} MiB" if mib >= 10 else f"{mib:.2f} MiB"


TITLES = {"full": "", "quick": " (quick run)", "smoke": " (smoke run: times mean nothing)"}
RUNS_COLUMNS = (
    "run",
    *(f"ITL {p} ms" for p in ("P50", "P90", "P99", "max")),
    *(f"{what} {p} ms" for what in ("TTFT", "queue") for p in ("P50", "P99")),
    *("tokens/s", "device hits", "host hits", "loads", "evictions device/host", "cores used"),
)
STEP_KINDS = ("all", "decode_only", "with_prefill", "with_device_load")
STEPS_COLUMNS = ("run", "mean batch", "all steps", "decode only", "with a prefill")
STEPS_COLUMNS += ("with a device load",)


def _run_row(label: str, run: dict) -> list:
    a = run["adapters"]
    itl = [run["itl"][f"{p}_ms"] for p in ("p50", "p90", "p99", "max")]
    waits = [run[what][f"{p}_ms"] for what in ("ttft", "queue") for p in ("p50", "p99")]
    hits = [f"{a[f'{t}_hits']}/{a[f'{t}_hits'] + a[f'{t}_misses']}" for t in ("device", "host")]
    tail = [a["loads"], f"{a['device_evictions']}/{a['host_evictions']}", run["cores_used"]]
    return [label, *itl, *waits, run["tokens_per_s"], *hits, *tail]


def _dist(d: dict) -> str:
    return f"{d['p50_ms']} / {d['p99_ms']} ({d['samples']})"


def _steps_row(label: str, steps: dict) -> list:
    return [label, steps["mean_batch"], *(_dist(steps[kind]) for kind in STEP_KINDS)]


def markdown(report: dict) -> Markdown:
    cfg, m = report["config"], report["machine"]
    churn, resident = report["churn"], report["resident"]
    both = (("churn", churn), ("all resident", resident))
    md = Markdown(
        f"Inter-token latency under adapter churn, {report['device']}{TITLES[cfg['mode']]}"
    )
    md.text(
        f"{cfg['model']}, {cfg['adapters']} registered adapters (ranks "
        f"{'/'.join(map(str, cfg['ranks']))}, q/k/v/o, bf16 on disk), uniform popularity: "
        f"{cfg['requests']} requests arriving as a Poisson process at {cfg['rate_per_s']:g}/s, "
        f"{cfg['max_tokens']} tokens each (EOS suppressed, greedy, float32), "
        f"{cfg['distinct_adapters_used']} distinct adapters used. Both runs in the same "
        "process on the same trace"
        + (f", {cfg['repeats']} runs of each, samples pooled." if cfg["repeats"] > 1 else ".")
    )
    md.bullets(
        [
            f"**churn**: host tier ~{cfg['host_adapters']} adapters "
            f"({_mib(cfg['churn_budgets']['adapter_host_bytes'])}), device pool "
            f"~{cfg['device_adapters']} adapters "
            f"({_mib(cfg['churn_budgets']['adapter_device_bytes'])}); cold adapters load from "
            "the local adapter folder on the engine's background loader thread.",
            f"**all resident**: a device pool for every used adapter "
            f"({_mib(cfg['resident_budgets']['adapter_device_bytes'])}); each was requested "
            "once before the trace (untimed, in order of first use, which packs adapters used "
            "at about the same time next to each other).",
        ]
    )
    md.table(RUNS_COLUMNS, [_run_row(label, run) for label, run in both])
    md.text(
        f"**Verdict: churn ITL P99 / all-resident ITL P99 = {report['ratio_itl_p99']:.3f}x "
        f"(target <= {report['target_ratio']:g}x): "
        f"{'met' if report['verdict_met'] else 'not met'}.** "
        f"(P50 ratio {report['ratio_itl_p50']:.3f}x.)",
        "Engine steps that produced tokens, wall ms, P50 / P99 (count):",
    )
    md.table(STEPS_COLUMNS, [_steps_row(label, run["steps"]) for label, run in both])
    forms = "; ".join(
        f"{label}: " + ", ".join(f"{k} {v}" for k, v in sorted(run["lora_forms"].items()))
        for label, run in both
    )
    spare = m["torch_threads"] < m["nproc"]
    md.text(
        f"Adapter loads on the loader thread (fetch + parse into float32): mean "
        f"{churn['adapters']['load_ms_mean']} ms. Preemptions: churn {churn['preemptions']}, "
        f"all resident {resident['preemptions']}. Adapters served by the steps: {forms}.",
        f"Threads: torch uses {m['torch_threads']} of {m['nproc']} cores in both runs"
        + (
            ", leaving a core for the adapter loader thread (on a GPU server loads run on "
            "host cores beside the GPU's compute; here they would otherwise take the "
            "compute threads' cores)."
            if spare
            else ", so the adapter loader thread competes with them for the cores in the churn run."
        )
        + " *cores used* = this process's CPU seconds / wall seconds during the trace, "
        "loader thread included. Latencies are measured from each request's arrival time "
        "in the trace.",
    )
    md.busy(report, m)
    if cfg["repeats"] > 1:
        per = "; ".join(
            f"{r['churn_itl_p99_ms']} / {r['resident_itl_p99_ms']} ({r['ratio_itl_p99']}x)"
            for r in report["per_repeat"]
        )
        md.text(f"Per repeat, ITL P99 churn / all resident ms (ratio): {per}.")
    md.machine(m, ("torch", "transformers"), f"Whole run {report['script_seconds']:.0f} s.")
    return md.command(report["command"])
