"""``loramux bench engine-vs-peft``'s markdown."""

from __future__ import annotations

from loramux.benchmarks.common.machine import busy_warning, machine_text


def _agreement_text(agree: dict) -> str:
    return (
        f"{agree['identical_requests']}/{agree['requests']} identical, mean common prefix "
        f"{agree['mean_common_prefix_tokens']} tokens"
    )


def _row(system: str, run: dict, agree: str) -> str:
    return (
        f"| {system} | {run['batch']} | {run['requests']} | {run['tokens']} "
        f"| {run['seconds']:.2f} | {run['tokens_per_s']:.1f} | {run['cores_used']} | {agree} |"
    )


def _runs_text(runs: list[dict]) -> str:
    return ", ".join(f"{r['tokens_per_s']:.1f} ({r['cores_used']})" for r in runs)


def render_markdown(report: dict) -> str:
    cfg, m, eng = report["config"], report["machine"], report["engine"]
    before = report.get("engine_before")
    after = " (after)" if before else ""
    repeats = cfg["repeats"]
    lines = [
        "# Engine vs transformers + PEFT (mixed-adapter generate), CPU",
        "",
        f"{cfg['model']}, {cfg['requests']} concurrent requests over {cfg['adapters']} "
        f"adapters (ranks {sorted(set(cfg['adapter_ranks']))}, targets q/k/v/o or all "
        f"seven; request i uses adapter i % {cfg['adapters']}), {cfg['max_tokens']} new "
        "tokens each (EOS suppressed), greedy, float32. Both measured in the same run on "
        "the same prompt token ids"
        + (f"; best of {repeats} interleaved runs each." if repeats > 1 else "."),
        "",
        "| system | batching | requests | tokens | wall s | tokens/s | cores used "
        f"| greedy agreement with engine{after} |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    if before:
        system = f"loramux engine (before, {before['sha'][:7]})"
        lines.append(_row(system, before, _agreement_text(before["agreement_with_after"])))
    lines.append(_row(f"loramux engine{after}", eng, "-"))
    for run in report["peft_runs"]:
        mark = " (baseline)" if run["label"] == report["baseline"] else ""
        agree = _agreement_text(run["agreement_with_engine"])
        lines.append(_row(f"transformers + PEFT{mark}", run, agree))
    ratio, target = report["ratio_engine_over_peft"], report["target_ratio"]
    lines += [
        "",
        f"**Ratio engine{after} / PEFT ({report['baseline']}): {ratio:.2f}x** (target >= "
        f"{target:g}x: {'met' if ratio >= target else 'not met'}).",
        "",
        f"Engine{after}: TTFT median {eng['ttft_median_s']} s, max {eng['ttft_max_s']} s; "
        f"preemptions {eng['preemptions']}; cached prompt tokens {eng['cached_prompt_tokens']}.",
        "",
        "*cores used* = this process's CPU seconds / wall seconds during the timed part "
        f"(torch uses {m['torch_threads']} threads): well below {m['torch_threads']} means "
        "other processes were competing for the cores while it was measured.",
    ]
    if before:
        head = eng["checkout"]
        changes = " with uncommitted changes in engine/ or kernels/"
        lines += [
            "",
            f"**Engine after / before: {report['ratio_after_over_before']:.2f}x tokens/s**; "
            f"greedy tokens {_agreement_text(before['agreement_with_after'])}. Before: "
            f"`{before['rev']}` = {before['sha'][:12]}; after: this checkout at "
            f"{head['head'][:12]}{changes if head['engine_or_kernels_modified'] else ''}. Both "
            f"engines ran in {report['engines_in']}, in alternating order, each importing "
            f"loramux from its own tree (before: `{before['imported_from']}`).",
        ]
    busy = {
        "contended": report["contended"],
        "max_loadavg_1m": report["reported_runs_max_loadavg_1m"],
        "min_cores_used": report.get("min_cores_used"),
    }
    lines += busy_warning(busy, m)
    if repeats > 1:
        runs = [("engine (before) ", before["all_runs"])] if before else []
        runs += [(f"engine{after} ", eng["all_runs"])]
        runs += [(f"{r['label']} ", r["all_runs"]) for r in report["peft_runs"]]
        text = "; ".join(label + _runs_text(all_runs) for label, all_runs in runs)
        lines += ["", f"All runs in order, tokens/s (cores used): {text}."]
    lines += [
        "",
        machine_text(m, ("torch", "transformers", "peft")),
        "",
        f"Command: `{report['command']}`",
        "",
    ]
    return "\n".join(lines)
