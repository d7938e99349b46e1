"""``loramux bench engine-vs-peft``'s report: the best run of each system, the ratio against
the goal, greedy agreement, and its markdown."""

from __future__ import annotations

from loramux.benchmarks.common import revisions
from loramux.benchmarks.common.adapters import ADAPTER_STD
from loramux.benchmarks.common.machine import contention
from loramux.benchmarks.common.measures import agreement
from loramux.benchmarks.common.report import Markdown
from loramux.benchmarks.serve.presets import PRESETS

GOAL = PRESETS["engine-vs-peft"].goals[0]


def _best(runs: list):
    return max(runs, key=lambda r: r.tokens_per_s)


def _entry(runs: list, best=None, **extra) -> dict:
    """The best of ``runs`` (``runner.RunResult``) with every run's tokens/s and cores used."""
    brief = [{"tokens_per_s": round(r.tokens_per_s, 2), **r.clock.summary()} for r in runs]
    return {**(best or _best(runs)).summary(), "all_runs": brief, **extra}


def build(args, work, machine: dict, engine_runs: dict, peft_runs: dict, checkouts) -> dict:
    """The report of ``runner.measure``'s runs; ``checkouts`` (after, before) with
    ``--before``."""
    labels = [f"engine ({c.label})" for c in checkouts] or ["engine"]
    after_runs, *before = (engine_runs[label] for label in labels)
    eng = _best(after_runs)
    best_peft = [_best(runs) for runs in peft_runs.values()]
    baseline = _best(best_peft)
    old = _best(before[0]) if before else None
    busy = contention([r.clock.summary() for r in [eng, *best_peft, *filter(None, [old])]], machine)
    ratio = round(eng.tokens_per_s / baseline.tokens_per_s, 3)
    spec = work.spec
    report = {
        "benchmark": "engine_vs_peft",
        "config": {
            "model": work.model_dir.name,
            "requests": spec.num_requests,
            "adapters": spec.num_adapters,
            "adapter_ranks": [a.rank for a in work.adapters],
            "adapter_targets": [list(a.targets) for a in work.adapters],
            "adapter_init_std": ADAPTER_STD,
            "max_tokens": spec.output_len[0],
            "dtype": "float32",
            "greedy": True,
            "fixed_length": "engine min_tokens=max_tokens; PEFT min_new_tokens=max_new_tokens",
            "prompt_tokens": [len(work.prompts[i]) for i in range(spec.num_requests)],
            "engine_config": work.engine_settings(),
            "peft_batch_sizes": args.peft_batch_sizes,
            "repeats": args.repeats,
            "workload": spec.to_json(),
        },
        "machine": machine,
        "engine": _entry(
            after_runs, runs_identical=all(r.tokens == eng.tokens for r in after_runs)
        ),
        "peft_runs": [
            _entry(runs, best, agreement_with_engine=agreement(eng.tokens, best.tokens))
            for best, runs in zip(best_peft, peft_runs.values(), strict=True)
        ],
        "baseline": baseline.label,
        "ratio_engine_over_peft": ratio,
        "target_ratio": GOAL.value,
        "target_met": GOAL.met_by(ratio),
        "greedy_agreement": agreement(eng.tokens, baseline.tokens),
        "reported_runs_max_loadavg_1m": busy["max_loadavg_1m"],
        "min_cores_used": busy["min_cores_used"],
        "contended": busy["contended"],
        "command": args.command_line,
    }
    if old is not None:
        after, before_checkout = checkouts
        report["engine"]["checkout"] = {
            "head": after.sha,
            "engine_or_kernels_modified": after.modified,
        }
        report["engine_before"] = _entry(
            before[0],
            old,
            runs_identical=all(r.tokens == old.tokens for r in before[0]),
            rev=before_checkout.rev,
            sha=before_checkout.sha,
            agreement_with_after=agreement(eng.tokens, old.tokens),
        )
        report["ratio_after_over_before"] = round(eng.tokens_per_s / old.tokens_per_s, 3)
        report["engines_in"] = f"worker processes (python -m {revisions.__name__}), one per run"
    return report


def _agreement(agree: dict) -> str:
    return (
        f"{agree['identical_requests']}/{agree['requests']} identical, mean common prefix "
        f"{agree['mean_common_prefix_tokens']} tokens"
    )


def _row(system: str, run: dict, agree: str) -> tuple:
    return (
        system,
        run["batch"],
        run["requests"],
        run["tokens"],
        f"{run['seconds']:.2f}",
        f"{run['tokens_per_s']:.1f}",
        run["cores_used"],
        agree,
    )


def markdown(report: dict) -> Markdown:
    cfg, m, eng = report["config"], report["machine"], report["engine"]
    before = report.get("engine_before")
    after = " (after)" if before else ""
    repeats = cfg["repeats"]
    md = Markdown("Engine vs transformers + PEFT (mixed-adapter generate), CPU").text(
        f"{cfg['model']}, {cfg['requests']} concurrent requests over {cfg['adapters']} "
        f"adapters (ranks {sorted(set(cfg['adapter_ranks']))}, targets q/k/v/o or all "
        f"seven; request i uses adapter i % {cfg['adapters']}), {cfg['max_tokens']} new "
        "tokens each (EOS suppressed), greedy, float32. Both measured in the same run on "
        "the same prompt token ids"
        + (f"; best of {repeats} interleaved runs each." if repeats > 1 else ".")
    )
    rows = []
    if before:
        system = f"loramux engine (before, {before['sha'][:7]})"
        rows.append(_row(system, before, _agreement(before["agreement_with_after"])))
    rows.append(_row(f"loramux engine{after}", eng, "-"))
    for run in report["peft_runs"]:
        mark = " (baseline)" if run["label"] == report["baseline"] else ""
        rows.append(
            _row(f"transformers + PEFT{mark}", run, _agreement(run["agreement_with_engine"]))
        )
    columns = ("system", "batching", "requests", "tokens", "wall s", "tokens/s", "cores used")
    md.table((*columns, f"greedy agreement with engine{after}"), rows, "llrrrrrl")
    ratio, target = report["ratio_engine_over_peft"], report["target_ratio"]
    md.text(
        f"**Ratio engine{after} / PEFT ({report['baseline']}): {ratio:.2f}x** (target >= "
        f"{target:g}x: {'met' if ratio >= target else 'not met'}).",
        f"Engine{after}: TTFT median {eng['ttft_median_s']} s, max {eng['ttft_max_s']} s; "
        f"preemptions {eng['preemptions']}; cached prompt tokens {eng['cached_prompt_tokens']}.",
        "*cores used* = this process's CPU seconds / wall seconds during the timed part "
        f"(torch uses {m['torch_threads']} threads): well below {m['torch_threads']} means "
        "other processes were competing for the cores while it was measured.",
    )
    if before:
        head = eng["checkout"]
        changes = " with uncommitted changes in engine/ or kernels/"
        md.text(
            f"**Engine after / before: {report['ratio_after_over_before']:.2f}x tokens/s**; "
            f"greedy tokens {_agreement(before['agreement_with_after'])}. Before: "
            f"`{before['rev']}` = {before['sha'][:12]}; after: this checkout at "
            f"{head['head'][:12]}{changes if head['engine_or_kernels_modified'] else ''}. Both "
            f"engines ran in {report['engines_in']}, in alternating order, each importing "
            f"loramux from its own tree (before: `{before['imported_from']}`)."
        )
    busy = {
        "contended": report["contended"],
        "max_loadavg_1m": report["reported_runs_max_loadavg_1m"],
        "min_cores_used": report.get("min_cores_used"),
    }
    md.busy(busy, m)
    if repeats > 1:
        runs = [("engine (before)", before["all_runs"])] if before else []
        runs += [(f"engine{after}", eng["all_runs"])]
        runs += [(r["label"], r["all_runs"]) for r in report["peft_runs"]]
        text = "; ".join(
            label + " " + ", ".join(f"{r['tokens_per_s']:.1f} ({r['cores_used']})" for r in rs)
            for label, rs in runs
        )
        md.text(f"All runs in order, tokens/s (cores used): {text}.")
    return md.machine(m, ("torch", "transformers", "peft")).command(report["command"])
