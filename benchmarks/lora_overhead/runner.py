"""``loramux bench lora-overhead``: what serving distinct adapters costs over the base model.

The preset's workload: SmolLM2-135M-Instruct in float32 on the CPU, one ``Engine`` with the
default ``EngineConfig`` (only ``model`` and ``device="cpu"`` set), 32 requests submitted
at once, exactly 64 tokens each (greedy, ``min_tokens = max_tokens``), prompts of 16 to 96
random token ids (EOS ids avoided). Request i uses adapter i % 16 (:data:`ADAPTER_MIX`:
ranks 8 and 16, q/k/v/o on 12 of 16 and all seven modules on 4).

On one engine: a warm-up (every adapter and the base model once), then ``--repeats`` pairs
of runs, *base* (no adapter) and *lora* (each request its adapter). Every run's prompts
get their own first token, so no run finds another's blocks in the prefix cache (the
report shows each run's cached prompt tokens). Per run: wall seconds, tokens/s, cores
used, the load average and the engine's residency counters over the run.

The ratio is the median over repeats of lora seconds / base seconds. A pair's two runs
follow each other in an order that alternates between repeats, so a drift in the
machine's speed favours neither side, and the median drops a pair a burst of other work
hit (best-over-best and median-over-median are reported beside it). The goal (at most
1.10) is judged on the full workload only. ``--smoke``: 4 requests, 4 adapters, 8 tokens,
1 repeat. The recorded ``bench_lora-overhead.*`` is ``loramux bench lora-overhead
--repeats 7``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path

from loramux.benchmarks.common.adapters import ALL_SEVEN, QKVO, AdapterSpec, prepare_adapters
from loramux.benchmarks.common.driver_engine import exact_length_params
from loramux.benchmarks.common.files import (
    add_output_options,
    check_output_options,
    pyplot,
    save_figure,
)
from loramux.benchmarks.common.machine import Clock, contention, machine_info
from loramux.benchmarks.common.models import MODEL_NAME, prepare_model
from loramux.benchmarks.common.report import Markdown, write
from loramux.benchmarks.common.workload import WorkloadSpec, requests_with_prompts
from loramux.benchmarks.serve.presets import PRESETS, Preset, judge_goals

DEFAULT_REPEATS = 3
ADAPTER_SEED = 1000  # adapter i's seed is 1000 + i, as engine-vs-peft's: the cache is shared
# Adapter i gets ADAPTER_MIX[i % 8]: ranks 8 and 16; q/k/v/o on most, all seven modules on
# some (of 16: 12 q/k/v/o, 4 all seven; each kind half rank 8, half rank 16).
ADAPTER_MIX = (
    (8, QKVO),
    (16, QKVO),
    (8, QKVO),
    (16, ALL_SEVEN),
    (8, QKVO),
    (16, QKVO),
    (8, ALL_SEVEN),
    (16, QKVO),
)
SMOKE = {"num_requests": 4, "num_adapters": 4, "output_tokens": 8, "repeats": 1}
WARMUP_TOKENS = 4
# The engine's residency counters, read before and after each run.
COUNTERS = ("preemptions", "adapter_evictions", "adapter_reloads", "adapter_room_wait_steps")
COUNTER_WORDS = {
    "preemptions": "preemptions",
    "adapter_evictions": "adapter evictions",
    "adapter_reloads": "adapter re-loads",
    "adapter_room_wait_steps": "adapter-room wait steps",
}


@dataclass
class Workload:
    """The requests every run serves, and the first token each run gives their prompts."""

    spec: WorkloadSpec
    model_dir: Path
    adapters: list[AdapterSpec]
    prompts: list[list[int]]  # per request; the first token is replaced by the run's marker
    adapter_names: list[str]  # per request: adapter i % num_adapters
    markers: list[int]  # run k's first token (k = 0: the warm-up); all distinct

    @property
    def output_tokens(self) -> int:
        return self.spec.output_len[0]

    def prompts_of(self, run: int) -> list[list[int]]:
        return [[self.markers[run], *prompt[1:]] for prompt in self.prompts]


def workload_spec(preset: Preset, *, smoke: bool, requests: int | None) -> WorkloadSpec:
    spec = preset.workload
    if smoke:
        tokens = SMOKE["output_tokens"]
        spec = dataclasses.replace(
            spec,
            num_requests=SMOKE["num_requests"],
            num_adapters=SMOKE["num_adapters"],
            output_len=(tokens, tokens),
        )
    if requests is not None:
        spec = dataclasses.replace(spec, num_requests=requests)
    if spec.output_len[0] != spec.output_len[1] or spec.output_lens or spec.base_fraction:
        raise ValueError("lora-overhead needs one fixed output length and no base-model share")
    return spec


def prepare(spec: WorkloadSpec, cache_dir: Path, runs: int) -> Workload:
    """The model, the adapters and the prompts (cached in ``cache_dir``)."""
    from loramux.engine.model.config import ModelConfig

    model_dir = prepare_model(cache_dir)
    config = ModelConfig.from_pretrained(model_dir)
    avoid = frozenset(config.eos_token_ids)
    adapters = prepare_adapters(
        cache_dir, model_dir, ADAPTER_MIX, spec.num_adapters, seed=ADAPTER_SEED
    )
    requests, prompts = requests_with_prompts(spec, vocab_size=config.vocab_size, avoid=avoid)
    markers = [t for t in range(config.vocab_size - 1, -1, -1) if t not in avoid][: runs + 1]
    return Workload(
        spec=spec,
        model_dir=model_dir,
        adapters=adapters,
        prompts=[prompts[r.index] for r in requests],
        adapter_names=[adapters[r.adapter].name for r in requests],
        markers=markers,
    )


# --- the engine's counters ----------------------------------------------------------------


def read_counters(engine) -> dict[str, int]:
    """The engine's residency counters now (``engine.stats().residency``)."""
    residency = engine.stats().residency
    return {name: getattr(residency, name) for name in COUNTERS}


# --- the runs -------------------------------------------------------------------------------


def warm_up(engine, work: Workload) -> None:
    """Every adapter once and the base model once, a few tokens each (prompts of run 0)."""
    prompts = work.prompts_of(0)
    count = len(work.adapters)
    batch = [prompts[k % len(prompts)] for k in range(count)] + [prompts[0]]
    names: list[str | None] = [spec.name for spec in work.adapters] + [None]
    engine.generate(batch, exact_length_params(WARMUP_TOKENS), adapters=names)


def timed_run(engine, work: Workload, kind: str, run: int) -> dict:
    """One run of every request, base (no adapter) or lora; its figures and counters."""
    prompts = work.prompts_of(run)
    adapters = work.adapter_names if kind == "lora" else None
    before = read_counters(engine)
    with Clock() as clock:
        outputs = engine.generate(
            prompts, exact_length_params(work.output_tokens), adapters=adapters
        )
    after = read_counters(engine)
    tokens = sum(len(o.token_ids) for o in outputs)
    return {
        "kind": kind,
        "run": run,
        "requests": len(outputs),
        "failed": sum(o.error is not None for o in outputs),
        # Requests that ended with fewer tokens than asked for (none, when lengths are fixed).
        "short": sum(len(o.token_ids) != work.output_tokens for o in outputs),
        "tokens": tokens,
        "seconds": round(clock.seconds, 3),
        "tokens_per_s": round(tokens / clock.seconds, 2),
        **clock.summary(),
        "cached_prompt_tokens": sum(o.metrics.cached_prompt_tokens for o in outputs),
        "counters": {name: after[name] - before[name] for name in COUNTERS},
    }


def measure(work: Workload, repeats: int) -> tuple[list[dict], dict]:
    """Warm-up, then ``repeats`` pairs of runs on one engine (base then lora, then lora then
    base, ...); the runs and the engine's config."""
    from loramux.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=str(work.model_dir), device="cpu"))
    try:
        for spec in work.adapters:
            engine.add_adapter(spec.name, spec.path)
        print(f"warm-up: {len(work.adapters)} adapters and the base model ...", flush=True)
        warm_up(engine, work)
        runs = []
        for repeat in range(repeats):
            # Alternating order: a drift in the machine's speed favours neither side.
            for kind in ("base", "lora") if repeat % 2 == 0 else ("lora", "base"):
                result = timed_run(engine, work, kind, run=len(runs) + 1)
                runs.append(result)
                _print_run(result, repeat)
        stats = engine.stats()
        config = {
            **{k: _plain(v) for k, v in dataclasses.asdict(engine.config).items() if k != "model"},
            "kv_blocks_total": stats.kv_blocks_total,
            "kv_block_size": stats.kv_block_size,
            "max_model_len": engine.max_model_len,
            "memory_plan": list(engine.memory_plan.describe()),
            # Which kernels ran: the backend, and on its torch backend which LoRA op.
            "kernels": engine.backend.name,
            "lora_op": getattr(engine.backend, "lora_op", None),
        }
    finally:
        engine.close()
    return runs, config


def _plain(value):
    return value if value is None or isinstance(value, bool | int | float | str) else str(value)


def _print_run(run: dict, repeat: int) -> None:
    counters = ", ".join(f"{k} {v}" for k, v in run["counters"].items())
    print(
        f"[{repeat}] {run['kind']}: {run['tokens']} tokens in {run['seconds']:.2f} s = "
        f"{run['tokens_per_s']:.1f} tok/s (cores used {run['cores_used']}); {counters}",
        flush=True,
    )


# --- the verdict ----------------------------------------------------------------------------


def summarize(runs: list[dict]) -> dict:
    """Best and median seconds of each kind, each repeat's lora / base ratio and their median
    (the judged ratio), and the best-over-best and median-over-median ratios beside it."""
    seconds = {kind: [r["seconds"] for r in runs if r["kind"] == kind] for kind in ("base", "lora")}
    best = {kind: min(values) for kind, values in seconds.items()}
    median = {kind: statistics.median(values) for kind, values in seconds.items()}
    pairs = [lora / base for base, lora in zip(seconds["base"], seconds["lora"], strict=True)]
    totals = {
        kind: {
            name: sum(r["counters"][name] for r in runs if r["kind"] == kind) for name in COUNTERS
        }
        for kind in ("base", "lora")
    }
    return {
        "best_seconds": best,
        "median_seconds": median,
        "lora_over_base_seconds": round(statistics.median(pairs), 4),
        "best_lora_over_base_seconds": round(best["lora"] / best["base"], 4),
        "median_lora_over_base_seconds": round(median["lora"] / median["base"], 4),
        "pair_ratios": [round(r, 4) for r in pairs],
        "ratio_rule": (
            "median over repeats of lora seconds / base seconds (each repeat's two runs back "
            "to back, their order alternating)"
        ),
        "counter_totals": totals,
    }


def judge(preset: Preset, summary: dict, runs: list[dict], unjudged: str | None) -> list[dict]:
    failed = sum(r["failed"] + r.get("short", 0) for r in runs)
    failures = f"{failed} request(s) failed or ended short" if failed else None
    return judge_goals(preset.goals, summary, unjudged=unjudged, failed=failures)


def unjudged_reason(preset: Preset, spec: WorkloadSpec, smoke: bool) -> str | None:
    if smoke:
        return "the smoke form (tiny workload)"
    if spec != preset.workload:
        return f"{spec.num_requests} requests, not the preset's {preset.workload.num_requests}"
    return None


# --- the report ---------------------------------------------------------------------------


def run_preset(preset: Preset, args: argparse.Namespace, command: str) -> dict:
    """Measure ``preset`` as ``args`` ask; the report (``command``: how it was run)."""
    smoke = bool(args.smoke)
    repeats = args.repeats or (SMOKE["repeats"] if smoke else DEFAULT_REPEATS)
    spec = workload_spec(preset, smoke=smoke, requests=args.requests)
    machine = machine_info()
    work = prepare(spec, args.cache_dir, runs=2 * repeats)
    print(
        f"{spec.num_requests} requests, {spec.num_adapters} adapters, {work.output_tokens} "
        f"tokens each; prompts of {min(map(len, work.prompts))} to "
        f"{max(map(len, work.prompts))} tokens; {repeats} x (base, lora)",
        flush=True,
    )
    runs, engine_config = measure(work, repeats)
    summary = summarize(runs)
    unjudged = unjudged_reason(preset, spec, smoke)
    return {
        "preset": preset.name,
        "description": preset.description,
        "smoke": smoke,
        "workload": spec.to_json(),
        "model": {"name": MODEL_NAME, "dtype": "float32", "device": "cpu"},
        "adapters": [
            {"name": a.name, "rank": a.rank, "targets": list(a.targets)} for a in work.adapters
        ],
        "prompt_tokens": [len(p) for p in work.prompts],
        "repeats": repeats,
        "engine_config": engine_config,
        "engine_config_note": "EngineConfig(model, device='cpu'); everything else the default",
        "runs": runs,
        **summary,
        "goals": judge(preset, summary, runs, unjudged),
        "machine": machine,
        **contention(runs, machine),
        "command": command,
    }


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, help="override the preset's request count")
    add_output_options(parser)
    parser.add_argument(
        "--repeats",
        type=int,
        help=f"interleaved (base, lora) pairs of runs (default {DEFAULT_REPEATS}, 1 with --smoke)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="4 requests, 4 adapters, 8 tokens, 1 repeat"
    )


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_output_options(parser, args)
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be positive")


def run(args: argparse.Namespace) -> int:
    """Measure, then write ``<out>/bench_lora-overhead[-smoke].{json,md}`` and the plot."""
    report = run_preset(PRESETS["lora-overhead"], args, args.command_line)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"bench_{report['preset']}{'-smoke' if report['smoke'] else ''}"
    write(stem, report, markdown(report, write_plot(report, stem)))
    return 0


def write_plot(report: dict, stem: Path) -> list[Path]:
    """Bars of each run's seconds, base beside lora per repeat, the best of each as a line."""
    plt = pyplot()
    if plt is None:
        return []
    runs = report["runs"]
    base = [r for r in runs if r["kind"] == "base"]
    lora = [r for r in runs if r["kind"] == "lora"]
    xs = list(range(len(base)))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for offset, label, series, color in (
        (-0.2, "base model", base, "tab:blue"),
        (0.2, f"{len(report['adapters'])} adapters", lora, "tab:orange"),
    ):
        bars = ax.bar([x + offset for x in xs], [r["seconds"] for r in series], 0.4, label=label)
        for bar in bars:
            bar.set_color(color)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        best = report["best_seconds"]["base" if series is base else "lora"]
        ax.axhline(best, color=color, linestyle=":", linewidth=1)
    ax.set_xticks(xs, [f"pair {x + 1}" for x in xs])
    ax.set_ylabel("wall seconds (lower is better)")
    ax.set_ylim(0, max(r["seconds"] for r in runs) * 1.3)
    ax.set_title(
        f"{report['preset']}: lora / base = {report['lora_over_base_seconds']:.3f} "
        "(median of the pairs)"
    )
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper center", ncol=2)
    note = (
        f"{report['workload']['num_requests']} requests x {report['workload']['output_len'][0]} "
        "tokens per run, one engine, pairs in alternating order (base, lora; lora, base; ...)"
    )
    return [save_figure(fig, stem.with_name(stem.name + "_seconds.png"), note=note)]


def markdown(report: dict, plots: list[Path]) -> Markdown:
    machine, cfg, best, median = (
        report[k] for k in ("machine", "engine_config", "best_seconds", "median_seconds")
    )
    doc = Markdown(f"loramux bench {report['preset']}").text(report["description"] + ".")
    if report["smoke"]:
        doc.text("**Smoke form**: a plumbing check at tiny sizes; its figures mean little.")
    columns = ("run", "kind", "wall s", "tokens", "tokens/s", "cores used")
    columns += ("cached prompt tokens", *COUNTER_WORDS.values())
    rows = [
        (
            r["run"],
            r["kind"],
            f"{r['seconds']:.2f}",
            r["tokens"],
            f"{r['tokens_per_s']:.1f}",
            r["cores_used"],
            r["cached_prompt_tokens"],
            *r["counters"].values(),
        )
        for r in report["runs"]
    ]
    doc.table(columns, rows, "rl")
    doc.text(
        f"**lora / base = {report['lora_over_base_seconds']:.3f}**, the median of the pairs' "
        "ratios (each pair's two runs back to back, in alternating order, so a drift in the "
        "machine's speed favours neither side): "
        + ", ".join(f"{r:.3f}" for r in report["pair_ratios"])
        + f". Beside it: best lora run over best base run {best['lora']:.2f} / "
        f"{best['base']:.2f} s = {report['best_lora_over_base_seconds']:.3f}; "
        f"median runs {median['lora']:.2f} / {median['base']:.2f} s = "
        f"{report['median_lora_over_base_seconds']:.3f}.",
        *(
            f"**Goal: lora / base seconds {g['relation']} {g['value']:g} ({g['why']}): "
            f"measured {g['measured']:.3f}, {g['verdict']}.**"
            for g in report["goals"]
        ),
        "Counters over all runs of each kind: "
        + "; ".join(
            f"{kind}: " + ", ".join(f"{COUNTER_WORDS[k]} {v}" for k, v in t.items())
            for kind, t in report["counter_totals"].items()
        )
        + ". Read as differences of engine.stats().residency before and after each run.",
        f"Engine: one instance for every run, EngineConfig(model, device='cpu'), everything "
        f"else the default: {'; '.join(cfg['memory_plan'])}; adapter_host_bytes "
        f"{_mib(cfg['adapter_host_bytes'])}, max_num_seqs {cfg['max_num_seqs']}, "
        f"max_num_batched_tokens {cfg['max_num_batched_tokens']}, dtype "
        f"{cfg['dtype'] or 'float32'}; kernels {cfg['kernels']}, LoRA by the "
        f"{cfg['lora_op'] or 'backend'} op. A warm-up (each adapter and the base model "
        f"once, {WARMUP_TOKENS} tokens) ran first; every run's prompts have their own first "
        "token, so no run reuses another's prefix cache.",
        "*cores used* = this process's CPU seconds / wall seconds during the run (torch "
        f"threads: {machine['torch_threads']}).",
    )
    doc.busy(report, machine).machine(machine).command(report["command"])
    return doc.plots(plots)


def _mib(value: int | None) -> str:
    return "unset (sized by the engine)" if value is None else f"{value / 2**20:.0f} MiB"
