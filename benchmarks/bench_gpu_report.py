"""The GPU runner's own report parts: published references, goals, markdown.

A goal is met only when every request was served; it is not judged (``met`` None, with
the reason) for the CPU smoke or a workload other than the preset's.
"""

from __future__ import annotations

import dataclasses

from loramux.benchmarks.bench_presets import Preset, judge_goals

METRIC_UNITS = {"requests_per_s": "req/s", "output_tokens_per_s": "output tok/s"}


def judge(preset: Preset, loramux: dict, unjudged: str | None) -> dict:
    """``{"references": [...], "goals": [...]}`` for loramux's figures of this run."""
    references = [
        {
            **dataclasses.asdict(ref),
            "loramux": loramux[ref.metric],
            "ratio": loramux[ref.metric] / ref.value,
        }
        for ref in preset.references
    ]
    failed = loramux["requests"]["failed"]
    failures = f"{failed} request(s) failed" if failed else None
    goals = judge_goals(preset.goals, loramux, unjudged=unjudged, failed=failures)
    return {"references": references, "goals": goals}


def unjudged_reason(preset: Preset, spec_adapters: int, smoke: bool) -> str | None:
    """Why this run's figures cannot be held against the goals, or None."""
    if smoke:
        return "the CPU smoke of the GPU runner (tiny shapes), not a GPU figure"
    if spec_adapters != preset.workload.num_adapters:
        return f"{spec_adapters} adapters, not the preset's {preset.workload.num_adapters}"
    return None


def _gib(value: int | None) -> str:
    if value is None:
        return "—"
    return f"{value / 2**30:.1f} GiB" if value >= 2**30 else f"{value / 2**20:.0f} MiB"


def markdown_lines(report: dict) -> list[str]:
    """Model, engine, baseline, agreement, memory, references and goals of a GPU run."""
    model, engine = report["model"], report["engine_config"]
    lines = [
        f"Model: {model['shape']} from config.json, random weights (load_format=random, seed "
        f"{model['seed']}, N(0, {model['weight_std']}²), norms 1), {model['dtype']}, on "
        f"{model['device']}. Adapters: {report['adapters']['source']}.",
        "",
        f"Engine: kv_cache_bytes {_gib(engine['kv_cache_bytes'])} (KV and resident adapters), "
        f"adapter_host_bytes {_gib(engine['adapter_host_bytes'])}, "
        f"{engine['adapter_load_workers']} loader threads, max_num_seqs "
        f"{engine['max_num_seqs']}, max_num_batched_tokens {engine['max_num_batched_tokens']}.",
    ]
    baseline = report["baseline"]
    if baseline is not None:
        lines += ["", f"Baseline: {baseline['policy']}."]
    if report["agreement"] is not None:
        a = report["agreement"]
        lines += [
            "",
            f"Greedy agreement (same weights in both): {a['identical_requests']}/{a['requests']} "
            "requests with identical tokens.",
        ]
    lines += [
        "",
        f"Peak GPU memory: loramux {_gib(report['loramux']['peak_gpu_bytes'])}"
        + ("" if baseline is None else f", baseline {_gib(baseline['peak_gpu_bytes'])}")
        + ".",
    ]
    if report["references"]:
        lines += [
            "",
            "| published | setting | figure | loramux (this run) | loramux / published |",
            "|---|---|---:|---:|---:|",
        ]
        for ref in report["references"]:
            unit = METRIC_UNITS.get(ref["metric"], ref["metric"])
            lines.append(
                f"| {ref['system']} | {ref['setting']} | {ref['value']:g} {unit} "
                f"| {ref['loramux']:.2f} {unit} | {ref['ratio']:.2f}x |"
            )
    for goal in report["goals"]:
        unit = METRIC_UNITS.get(goal["metric"], goal["metric"])
        why = f" ({goal['why']})" if goal["why"] else ""
        lines += [
            "",
            f"**Goal: loramux {unit} {goal['relation']} {goal['value']:g}{why}: measured "
            f"{goal['measured']:.2f}, {goal['verdict']}.**",
        ]
    return lines
