"""``loramux bench speculative``'s summaries (per workload and batch size, over its pairs),
verdicts, markdown and plot; ``LEGEND`` says what each figure is."""

from __future__ import annotations

import statistics
from pathlib import Path

from loramux.benchmarks.common.files import pyplot, save_figure
from loramux.benchmarks.common.report import Markdown, pct, write
from loramux.benchmarks.serve.presets import Goal, judge_goals

# What the summary table's columns mean (the tables' own words).
LEGEND = (
    "tok/s: output tokens over wall seconds of a run (prefill included, the same on both "
    "engines), the median over pairs; speedup: the median over pairs of ngram tok/s / off "
    "tok/s (each pair's two runs back to back on the same requests, their order "
    "alternating); decode-phase speedup: the same after the prompts (the pairs' median "
    "of output tokens after each request's first over the seconds after the last first "
    "token; not judged), and prefill share: the off runs' seconds until every request "
    "had its first token, over their wall seconds (at batch 1 the part speculation "
    "cannot shorten; at batch 4, where 8 requests pass through 4 slots, the last starts "
    "late and the figure means little); engine steps: the median over runs of the "
    "engine's steps after the last first token; ms/step: the median over runs of the mean "
    "milliseconds of such a step (every running request's next token, and on ngram the "
    "verification of its proposals); acceptance: accepted / proposed tokens; "
    "tokens/step: output tokens / decode steps of the ngram runs' requests (1 with "
    "speculation off); tokens/request: the mean output length, and how many requests "
    "ended at EOS before the limit."
)


def _median(values, digits: int) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), digits) if values else None


def summarize(results: list[dict]) -> list[dict]:
    """One summary per (workload, batch size) of ``runner.measure``'s results."""
    summaries = []
    for result in results:
        pairs = result["pairs"]
        off, ngram = [p["off"] for p in pairs], [p["ngram"] for p in pairs]
        proposed = sum(r["proposed"] for r in ngram)
        accepted = sum(r["accepted"] for r in ngram)
        tokens = sum(r["tokens"] for r in ngram)
        steps = sum(r["decode_steps"] for r in ngram)
        requests = [q for r in ngram for q in r["requests"]]
        summaries.append(
            {
                "workload": result["workload"],
                "batch": result["batch"],
                "pairs": len(pairs),
                "speedup": _median((p["speedup"] for p in pairs), 4),
                "speedups": [p["speedup"] for p in pairs],
                "off_tokens_per_s": _median((r["tokens_per_s"] for r in off), 3),
                "ngram_tokens_per_s": _median((r["tokens_per_s"] for r in ngram), 3),
                "decode_speedup": _median(
                    (
                        b["decode_tokens_per_s"] / a["decode_tokens_per_s"]
                        for a, b in zip(off, ngram, strict=True)
                    ),
                    4,
                ),
                "prefill_share_off": _median((r["prefill_seconds"] / r["seconds"] for r in off), 4),
                # The engine's steps after the last request's first token.
                "off_engine_decode_steps": _median((r["engine_decode_steps"] for r in off), 2),
                "ngram_engine_decode_steps": _median((r["engine_decode_steps"] for r in ngram), 2),
                "off_ms_per_decode_step": _median((r["ms_per_decode_step"] for r in off), 2),
                "ngram_ms_per_decode_step": _median((r["ms_per_decode_step"] for r in ngram), 2),
                "proposed": proposed,
                "accepted": accepted,
                "acceptance": round(accepted / proposed, 4) if proposed else None,
                "tokens_per_step": round(tokens / steps, 3) if steps else None,
                "off_tokens_per_step": round(
                    sum(r["tokens"] for r in off) / sum(r["decode_steps"] for r in off), 3
                ),
                "tokens_per_request": round(tokens / len(requests), 1),
                "ended_at_eos": sum(q["finish_reason"] == "stop" for q in requests),
                "requests_served": len(requests),
                "outputs_match": all(p["outputs_match"] for p in pairs),
                "mismatched_requests": sum(len(p["mismatches"]) for p in pairs),
            }
        )
    return summaries


def judge(goals: tuple[Goal, ...], summaries: list[dict], args) -> list[dict]:
    """Each goal at each batch size (``<workload>_speedup`` of that batch's workloads)."""
    unjudged = "the smoke form (tiny workload)" if args.smoke else None
    judged = []
    for batch in args.batch_sizes:
        rows = [s for s in summaries if s["batch"] == batch]
        figures = {f"{s['workload']}_speedup": s["speedup"] for s in rows}
        differ = sum(s["mismatched_requests"] for s in rows)
        failed = f"outputs differed in {differ} request(s)" if differ else None
        present = tuple(g for g in goals if g.metric in figures)
        for goal in judge_goals(present, figures, unjudged=unjudged, failed=failed):
            judged.append({"batch": batch, **goal})
    return judged


def write_plot(report: dict, stem: Path) -> list[Path]:
    """Left: median tokens/s off and ngram per workload and batch size, the speedup over
    each pair of bars (green where it meets its goal). Right: the ngram runs' tokens per
    step, the acceptance rate on each."""
    plt = pyplot()
    if plt is None:
        return []
    rows = sorted(report["summaries"], key=lambda s: (s["workload"] != "copy", s["batch"]))
    goals = {(g["batch"], g["metric"]): g["value"] for g in report["goals"]}
    xs = list(range(len(rows)))
    labels = [f"{s['workload']}\nbatch {s['batch']}" for s in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 4.4), width_ratios=(3, 2))
    for offset, name, color in ((-0.2, "off", "tab:gray"), (0.2, "ngram", "tab:blue")):
        values = [s[f"{name}_tokens_per_s"] for s in rows]
        bars = left.bar(
            [x + offset for x in xs], values, 0.4, label=f"speculation {name}", color=color
        )
        left.bar_label(bars, fmt="%.1f", fontsize=8)
    top = max(max(s["off_tokens_per_s"], s["ngram_tokens_per_s"]) for s in rows)
    for x, s in zip(xs, rows, strict=True):
        met = s["speedup"] >= goals[s["batch"], f"{s['workload']}_speedup"]
        left.text(
            x,
            top * 1.12,
            f"{s['speedup']:.2f}x",
            ha="center",
            fontsize=10,
            fontweight="bold",
            color="tab:green" if met else "tab:red",
        )
    left.set_xticks(xs, labels)
    left.set_ylim(0, top * 1.45)
    left.set_ylabel("output tokens/s (median of the pairs)")
    left.set_title(
        "tokens/s; ngram / off speedup above (goals: copy ≥1.5x, chat ≥0.95x)", fontsize=9
    )
    left.legend(loc="upper center", ncol=2, fontsize=8)
    left.grid(axis="y", alpha=0.3)

    steps = [s["tokens_per_step"] or 0 for s in rows]
    bars = right.bar(xs, steps, 0.55, color="tab:blue")
    accepted = [
        "none proposed" if s["acceptance"] is None else f"{s['acceptance']:.0%} accepted"
        for s in rows
    ]
    right.bar_label(bars, labels=accepted, fontsize=7)
    right.axhline(1.0, color="tab:gray", linestyle=":", linewidth=1)
    right.set_xticks(xs, labels)
    right.set_ylim(0, max([*steps, 1.0]) * 1.25)
    right.set_ylabel("output tokens per decode step (ngram)")
    right.set_title("ngram runs: tokens per step (bars), acceptance rate (labels)", fontsize=9)
    right.grid(axis="y", alpha=0.3)
    note = (
        f"{report['model']}, CPU float32, greedy, ≤{report['tokens']} tokens a request, "
        f"{report['repeats']} pair(s) each, torch threads {report['machine']['torch_threads']}"
    )
    return [save_figure(fig, stem.with_suffix(".png"), note=note)]


def _summary_row(s: dict) -> dict:
    """The summary table's row of ``s``, by column."""
    per_pair = ", ".join(f"{x:.2f}" for x in s["speedups"])
    return {
        "workload": s["workload"],
        "batch": s["batch"],
        "pairs": s["pairs"],
        "off tok/s": f"{s['off_tokens_per_s']:.2f}",
        "ngram tok/s": f"{s['ngram_tokens_per_s']:.2f}",
        "**speedup** (per pair)": f"**{s['speedup']:.3f}x** ({per_pair})",
        "decode-phase speedup": f"{s['decode_speedup']:.3f}x",
        "prefill share (off)": pct(s["prefill_share_off"], 1),
        "engine steps off → ngram": (
            f"{s['off_engine_decode_steps']:g} → {s['ngram_engine_decode_steps']:g}"
        ),
        "ms/step off → ngram": f"{s['off_ms_per_decode_step']} → {s['ngram_ms_per_decode_step']}",
        "acceptance": pct(s["acceptance"], 1),
        "tokens/step": s["tokens_per_step"],
        "accepted / proposed": f"{s['accepted']} / {s['proposed']}",
        "tokens/request (EOS)": (
            f"{s['tokens_per_request']} ({s['ended_at_eos']} of {s['requests_served']})"
        ),
        "outputs": "identical" if s["outputs_match"] else f"**{s['mismatched_requests']} differ**",
    }


def _pair_row(result: dict, p: dict) -> dict:
    """The pairs table's row of pair ``p`` of ``result``, by column."""
    ngram = p["ngram"]
    differ = "; ".join(
        f"request {m['request']} from token {m['first_difference']}" for m in p["mismatches"]
    )
    return {
        "workload": result["workload"],
        "batch": result["batch"],
        "pair": p["pair"] + 1,
        "requests": p["requests"],
        "order": ", ".join(p["order"]),
        "off s": f"{p['off']['seconds']:.2f}",
        "ngram s": f"{ngram['seconds']:.2f}",
        "speedup": f"{p['speedup']:.3f}",
        "accepted / proposed": f"{ngram['accepted']} / {ngram['proposed']}",
        "tokens/step": ngram["tokens_per_step"],
        "outputs": "identical" if p["outputs_match"] else f"DIFFER: {differ}",
    }


def _table(md: Markdown, rows: list[dict], align: str) -> Markdown:
    return md.table(list(rows[0]), [list(row.values()) for row in rows], align)


def markdown(report: dict, plots: list[Path]) -> Markdown:
    md = Markdown(f"loramux bench {report['preset']}").text(report["description"] + ".")
    if report["smoke"]:
        md.text("**Smoke form**: a plumbing check at tiny sizes; its figures mean little.")
    if not report["outputs_identical"]:
        md.text(
            "**FAILED: the two engines' output token ids differ** (see the mismatches below "
            "and `mismatches` in the JSON): speculation must not change greedy output."
        )
    _table(md, [_summary_row(s) for s in report["summaries"]], "lrrrrlrrrrrrrrl").text(LEGEND)
    md.text(
        *(
            f"**Goal at batch {g['batch']}: {g['metric'].replace('_', ' ')} {g['relation']} "
            f"{g['value']:g} ({g['why']}): measured {g['measured']:.3f}, {g['verdict']}.**"
            for g in report["goals"]
        )
    )
    pairs = [_pair_row(r, p) for r in report["results"] for p in r["pairs"]]
    _table(md.section("Pairs"), pairs, "lrrllrrrrrl")
    cfg, machine = report["engine_configs"]["ngram"], report["machine"]
    prompt_tokens = "; ".join(f"{w}: {n}" for w, n in report["prompt_tokens"].items())
    md.text(
        f"Engines: {report['model']}, two in one process, alike but for speculative_method "
        f"(off / {cfg['speculative_method']}: num_speculative_tokens "
        f"{cfg['num_speculative_tokens']}, n-grams of {cfg['ngram_max_n']} down to "
        f"{cfg['ngram_min_n']} tokens, adaptive draft length); dtype {cfg['dtype']}, "
        f"device {cfg['device']}, prefix caching {cfg['enable_prefix_caching']}. Greedy, "
        f"at most {report['tokens']} tokens a request, EOS ends a request. Prompt tokens "
        f"{prompt_tokens}. A warm-up of each engine preceded each workload and batch size.",
        "Counters: the engine's loramux_spec_proposed_tokens, loramux_spec_accepted_tokens, "
        "loramux_decode_steps and loramux_adapter_generated_tokens over each run "
        + ("agree" if report["counters_agree"] else "**do not agree**")
        + " with the requests' own metrics.",
        f"contention: {report['contention']}",
    )
    md.busy(report["contention"], machine).machine(machine).command(report["command"])
    return md.plots(plots)


def write_results(stem: Path, report: dict) -> None:
    """``<stem>.{json,md,png}``, and the markdown on stdout."""
    write(stem, report, markdown(report, write_plot(report, stem)))
