"""``loramux bench prefill-flood``'s figures, plot and markdown from the run's records.

* **Victim TTFT** per phase, from sending the probe to its first token's chunk: idle, and
  during each attack; each attack's P50 and P99 as multiples of the idle P50 (the goals:
  at most ``P50_GOAL`` and ``P99_GOAL``). With a dozen probes the P99 is about the worst.
* **The attack's own times**: from sending to the engine busy with it, and from its client
  leaving to the engine idle again (what an abandoned request still holds).
* **Delivered and billed**: each attack's prompt tokens sent and billed (its requests'
  usage records, those abandoned mid-prefill included), completion tokens delivered in the
  responses and billed; the victim's tokens received and billed.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from loramux.benchmarks.common.files import pyplot, save_figure
from loramux.benchmarks.common.machine import machine_text
from loramux.benchmarks.common.report import Markdown, num, write

P50_GOAL = 5.0  # victim TTFT P50 under an attack, in idle P50s
P99_GOAL = 20.0


def _ttft_stats(probes: list[dict]) -> dict:
    ttfts = np.asarray([p["ttft_s"] for p in probes if p["ttft_s"] is not None])
    stats = {"n": len(ttfts), "errors": [p["error"] for p in probes if p["error"]]}
    for key, value in (("p50_s", 50), ("p99_s", 99), ("max_s", 100)):
        stats[key] = round(float(np.percentile(ttfts, value)), 4) if len(ttfts) else None
    return stats


def _ratio(value: float | None, idle: float | None) -> float | None:
    return None if value is None or not idle else round(value / idle, 2)


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round(end - start, 2)


def summarize(run: dict) -> dict:
    probes = run["probes"]
    idle = _ttft_stats([p for p in probes if p["phase"] == "idle"])
    attacks = {}
    for attack in run["attacks"]:
        name, usage = attack["name"], attack["usage"]
        stats = _ttft_stats([p for p in probes if p["phase"] == name])
        p50 = _ratio(stats["p50_s"], idle["p50_s"])
        p99 = _ratio(stats["p99_s"], idle["p50_s"])
        attacks[name] = {
            "ttft": stats,
            "p50_over_idle": p50,
            "p99_over_idle": p99,
            "meets_goals": p50 is not None and p50 <= P50_GOAL and p99 <= P99_GOAL,
            "to_busy_s": _span(attack["started_s"], attack["busy_s"]),
            "busy_after_leaving_s": _span(attack["left_s"], attack["idle_s"]),
            "outcomes": attack["outcomes"],
            "sent_prompt_tokens": attack["sent_prompt_tokens"],
            "billed_prompt_tokens": sum(row["prompt_tokens"] for row in usage),
            "billed_cached_prompt_tokens": sum(row["cached_prompt_tokens"] for row in usage),
            "delivered_completion_tokens": attack["delivered_completion_tokens"],
            "billed_completion_tokens": sum(row["completion_tokens"] for row in usage),
            "usage_records": len(usage),
        }
    victim = {  # every probe, warm-ups included
        "received_tokens": sum(p["tokens"] for p in probes),
        "billed_completion_tokens": sum(r["completion_tokens"] for r in run["victim_usage"]),
        "usage_records": len(run["victim_usage"]),
        "probes": len(probes),
        "probe_errors": [p["error"] for p in probes if p["error"]],
    }
    return {
        "idle": idle,
        "attack_figures": attacks,
        "victim": victim,
        "goals_met": all(a["meets_goals"] for a in attacks.values()),
    }


def write_plots(report: dict, stem: Path) -> list[Path]:
    """The victim's TTFT in each phase against its idle P50 (none without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return []
    probes = report["raw"]["probes"]
    phases = ["idle", *report["attack_figures"]]
    idle = report["idle"]["p50_s"]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    rng = np.random.default_rng(0)
    for k, phase in enumerate(phases):
        values = [p["ttft_s"] for p in probes if p["phase"] == phase and p["ttft_s"] is not None]
        x = k + rng.uniform(-0.15, 0.15, size=len(values))
        ax.scatter(x, values, s=18, color=f"C{k}", alpha=0.8, zorder=3)
        if values:
            ax.hlines(np.median(values), k - 0.3, k + 0.3, color="black", lw=2, zorder=4)
    if idle:
        for times, style, label in (
            (1, "-", "idle P50"),
            (P50_GOAL, "--", ""),
            (P99_GOAL, ":", ""),
        ):
            ax.axhline(idle * times, color="grey", ls=style, lw=1)
            label = label or f"{times:g}x idle"
            ax.text(
                len(phases) - 0.5, idle * times, f" {label}", fontsize=7, color="grey", va="center"
            )
    ax.set_yscale("log")
    ax.set_xticks(range(len(phases)), phases, fontsize=8)
    ax.set_xlim(-0.5, len(phases) - 0.1)
    ax.set_ylabel("victim's time to first token (s)")
    ax.set_title("A victim tenant's first token while another tenant floods prefill (bar: median)")
    note = machine_text(report["machine"]).split(" Date")[0]
    return [save_figure(fig, stem.with_name(stem.name + "_ttft.png"), note=note)]


def _what(attack: dict) -> str:
    shape = f"{attack['prompts']} x {attack['prompt_tokens']} tokens"
    how = "one request" if attack["requests"] == 1 else f"{attack['requests']} requests"
    leaves = ", echo + logprobs, client leaves after 2 s" if attack["echo"] else ""
    return f"{shape}, {how}{leaves}"


def render_markdown(report: dict, plots: list[Path]) -> Markdown:
    idle, engine, config = report["idle"], report["raw"]["engine"], report["config"]
    victim, figures = report["victim"], report["attack_figures"]
    whats = {a["name"]: _what(a) for a in report["attacks"]}
    seconds = lambda value: num(value, 3, suffix=" s")  # noqa: E731
    md = Markdown(f"bench {report['preset']}{' (smoke)' if config['smoke'] else ''}")
    md.text(
        f"`{report['command']}` on the {report['model']}, served as `loramux serve` serves it "
        f"(SQLite, in-process engine, default engine settings) with {report['settings']}. "
        f"Two tenants of priority 5 and weight 1. The victim streams a "
        f"{config['probe_prompt_tokens']}-token prompt for {config['probe_output_tokens']} "
        f"tokens; during each attack it probes {config['probes']} times, every "
        f"{config['probe_interval']} s, once the engine is busy with the attack.",
        f"Engine: {engine['threads']}; prompt tokens per step sized to "
        f"{engine['step_target_s']} s (last budget {engine['prefill_budget_tokens']} tokens, "
        f"at most {engine['max_num_batched_tokens']}).",
        f"**Victim idle TTFT: P50 {seconds(idle['p50_s'])}, P99 {seconds(idle['p99_s'])} "
        f"({idle['n']} probes).** Goals under each attack: P50 at most {P50_GOAL:g}x and "
        f"P99 at most {P99_GOAL:g}x the idle P50: "
        f"**{'met' if report['goals_met'] else 'NOT met'}**.",
    )
    md.table(
        (
            "attack",
            "what",
            "victim TTFT P50",
            "P99",
            "max",
            "P50 / idle",
            "P99 / idle",
            "goals",
            "engine busy after the client left",
        ),
        [
            (
                name,
                whats[name],
                *(seconds(a["ttft"][k]) for k in ("p50_s", "p99_s", "max_s")),
                *(num(a[k], 1, suffix="x") for k in ("p50_over_idle", "p99_over_idle")),
                "met" if a["meets_goals"] else "not met",
                seconds(a["busy_after_leaving_s"]),
            )
            for name, a in figures.items()
        ],
        "llrrrrrlr",
    )
    md.text("Delivered and billed, per attack (the attacker's usage records):")
    md.table(
        (
            "attack",
            "requests (status)",
            "prompt tokens sent",
            "billed",
            "of which cached",
            "completion tokens delivered",
            "billed",
            "usage records",
        ),
        [
            (
                name,
                ", ".join(f"{n} {o}" for o, n in Counter(a["outcomes"]).items()),
                *(num(a[k], 0) for k in BILLING),
            )
            for name, a in figures.items()
        ],
        "ll",
    )
    md.text(
        f"Victim: {victim['received_tokens']} tokens received over {victim['probes']} "
        f"probes, {victim['billed_completion_tokens']} billed in {victim['usage_records']} "
        f"records; probe errors: {len(victim['probe_errors'])}."
    )
    md.plots(plots)
    return md.machine(
        report["machine"],
        note=f"Load average before {report['loadavg_before']}, after {report['loadavg_after']}.",
    )


BILLING = (
    "sent_prompt_tokens",
    "billed_prompt_tokens",
    "billed_cached_prompt_tokens",
    "delivered_completion_tokens",
    "billed_completion_tokens",
    "usage_records",
)


def write_results(stem: Path, report: dict, run: dict) -> None:
    """The figures, the plot and the report (``<stem>.{json,md}``) of ``run``."""
    report |= summarize(run) | {"raw": run}
    stem.parent.mkdir(parents=True, exist_ok=True)
    write(stem, report, render_markdown(report, write_plots(report, stem)))
