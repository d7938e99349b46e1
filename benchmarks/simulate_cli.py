"""``loramux bench simulate``: the command line of ``simulate_runs.py`` (see ``simulate.py``).

    loramux bench simulate calibrate [--profile P]
    loramux bench simulate slora [--setting S2] [--adapters 5,100,1000,2000] [--rates 10,40]
    loramux bench simulate churn [--setting S2] [--capacity 100] [--factors 0.5,1,2,4]

Writes ``simulation_calibration_<profile>.{json,md}``,
``simulation_slora-<setting>[-host]-<rates>rps_<profile>.{json,md}`` or
``simulation_churn-<setting>-<rate>rps_<profile>.{json,md,png}`` into the results folder.
Every figure in them is simulated, and says so with the profile and its calibration beside
it.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from loramux.benchmarks.common.files import (
    RESULTS_DIR,
    add_output_options,
    check_output_options,
    write_report,
)
from loramux.benchmarks.common.models import prepare_model
from loramux.benchmarks.common.slora_workloads import SETTINGS, TABLE_ADAPTERS
from loramux.benchmarks.simulate import DEFAULT_PROFILE
from loramux.benchmarks.simulate_churn import (
    CHURN_DURATION_S,
    CHURN_FACTORS,
    DEFAULT_CAPACITY,
    churn_markdown,
    churn_plot,
    churn_sweep,
)
from loramux.benchmarks.simulate_runs import calibration, per_minute_cell, slora_table
from loramux.engine.simulation.profile import PROFILES_DIR, DeviceProfile


def _numbers(kind):
    def parse(text: str) -> list:
        try:
            return [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None

    return parse


def _engine_setting(text: str) -> tuple[str, int | float]:
    """``NAME=VALUE`` of an ``EngineConfig`` field with a number for its value."""
    from dataclasses import fields

    from loramux.engine.config import EngineConfig

    name, _, value = text.partition("=")
    known = {f.name for f in fields(EngineConfig)}
    if name not in known:
        raise argparse.ArgumentTypeError(f"{name!r} is not an engine setting (EngineConfig field)")
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the value must be a number") from None
    return name, int(number) if number.is_integer() else number


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="loramux bench simulate", description=__doc__)
    parser.add_argument("what", choices=("calibrate", "slora", "churn"))
    parser.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help="device profile (a name, a path, or 'auto': this machine's GPU's, else the H100's)",
    )
    parser.add_argument(
        "--recorded",
        type=Path,
        default=RESULTS_DIR,
        help="calibrate: the folder of the recorded GPU runs (default: the results folder)",
    )
    parser.add_argument(
        "--suffix",
        default="",
        help="calibrate: the recorded files' suffix ('-smoke': the CPU smoke's, a plumbing check)",
    )
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="S2")
    parser.add_argument(
        "--adapters",
        type=_numbers(int),
        default=list(TABLE_ADAPTERS[1:]),
        help="adapter counts (default: S-LoRA's table from 5)",
    )
    parser.add_argument(
        "--rates",
        type=_numbers(float),
        help="offered requests per second (default: the setting's, S-LoRA's)",
    )
    parser.add_argument("--duration", type=float, help="seconds of arrivals (default: S-LoRA's)")
    parser.add_argument(
        "--host-resident",
        action="store_true",
        help="slora: every adapter in host RAM when the run starts (S-LoRA's setting)",
    )
    parser.add_argument(
        "--capacity",
        type=int,
        default=DEFAULT_CAPACITY,
        help="churn: the adapters (of the setting's rank mix) the device's adapter room holds",
    )
    parser.add_argument(
        "--factors",
        type=_numbers(float),
        default=list(CHURN_FACTORS),
        help="churn: working sets as multiples of --capacity",
    )
    parser.add_argument(
        "--set",
        dest="engine",
        action="append",
        type=_engine_setting,
        default=[],
        metavar="NAME=VALUE",
        help="slora: an engine setting over the GPU presets' (repeatable), e.g. max_num_seqs=256",
    )
    add_output_options(parser)
    args = parser.parse_args(argv)
    check_output_options(parser, args)
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    command = " ".join(["loramux bench simulate", *argv])
    profile = DeviceProfile.load(resolve_profile(args.profile))
    tokenizer = prepare_model(args.cache_dir)  # SmolLM2's tokenizer ids decode Llama's
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "calibrate":
        report = {
            "command": command,
            **calibration(profile, args.cache_dir, tokenizer, args.recorded, args.suffix),
        }
        stem = args.out / f"simulation_calibration_{profile.name}{args.suffix}"
        write_report(stem, report, calibration_markdown(report))
        return 0
    rates = args.rates or [SETTINGS[args.setting].rate]
    if args.what == "churn":
        report = {
            "command": command,
            **churn_sweep(
                args.setting,
                profile,
                args.cache_dir,
                tokenizer,
                capacity=args.capacity,
                factors=tuple(args.factors),
                rate=rates[0],
                duration_s=args.duration or CHURN_DURATION_S,
            ),
        }
        stem = args.out / f"simulation_churn-{args.setting}-{rates[0]:g}rps_{profile.name}"
        plot = churn_plot(report, stem.with_suffix(".png"))
        write_report(stem, report, churn_markdown(report, plot))
        return 0
    report = {
        "command": command,
        **slora_table(
            args.setting,
            profile,
            args.cache_dir,
            tokenizer,
            args.adapters,
            rates,
            args.duration,
            args.host_resident,
            dict(args.engine),
        ),
    }
    where = "-host" if args.host_resident else ""
    where += "".join(f"-{name}={value}" for name, value in args.engine)
    offered = "-".join(f"{r:g}" for r in rates)
    stem = args.out / f"simulation_slora-{args.setting}{where}-{offered}rps_{profile.name}"
    write_report(stem, report, slora_markdown(report))
    return 0


def resolve_profile(name: str) -> str:
    """``auto``: the profile named after this machine's GPU (as ``kernels_gpu`` names its
    files), if there is one; else the H100's."""
    if name != "auto":
        return name
    import torch

    if torch.cuda.is_available():
        gpu = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
        if (PROFILES_DIR / f"{gpu}.json").is_file():
            return gpu
    return DEFAULT_PROFILE


def _fmt(value: float) -> str:
    return f"{value:,.4g}"


def calibration_markdown(report: dict) -> str:
    lines = [
        f"# Simulation calibration: {report['profile']}",
        "",
        f"**Every simulated figure here is {report['label']}.** Measured figures are the "
        "recorded GPU runs "
        + ", ".join(f"`{Path(p).name}`" for p in report.get("recorded", {}).values())
        + ", each replayed with its own workload, model shapes and engine settings.",
        "",
        f"Command: `{report.get('command', '')}`",
        "",
        "| run | figure | unit | measured | simulated | error |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in report["rows"]:
        error = "—" if r["error"] is None else f"{r['error']:+.0%}"
        lines.append(
            f"| {r['run']} | {r['figure']} | {r['unit']} | {_fmt(r['measured'])} | "
            f"{_fmt(r['simulated'])} | {error} |"
        )
    for run, both in report.get("steps", {}).items():
        lines += ["", *steps_markdown(run, both["measured"], both["simulated"])]
    return "\n".join(lines) + "\n"


def steps_markdown(run: str, measured: dict | None, simulated: dict) -> list[str]:
    """Median step time by batch size, measured beside simulated."""
    lines = [
        f"## {run}: step by step",
        "",
        "Median milliseconds of a whole `step()` by the sequences in its batch, decode-only "
        "and mixed (with prompt tokens). "
        + (
            ""
            if measured
            else "The recorded run has no step record (runs before step "
            "tracing); the measured column waits for the next GPU run."
        ),
        "",
        "| sequences | batch | measured steps | measured ms | simulated steps | simulated ms |",
        "|---|---|---:|---:|---:|---:|",
    ]
    keyed = {}
    for side, summary in (("measured", measured), ("simulated", simulated)):
        for b in (summary or {}).get("bins", []):
            key = (tuple(b["sequences"]), b["decode_only"])
            keyed.setdefault(key, {})[side] = b
    for (seqs, decode_only), sides in sorted(keyed.items()):
        cells = []
        for side in ("measured", "simulated"):
            b = sides.get(side)
            cells += ["—", "—"] if b is None else [str(b["steps"]), f"{b['median_ms']:.1f}"]
        kind = "decode-only" if decode_only else "mixed"
        lines.append(f"| {seqs[0]}-{seqs[1]} | {kind} | " + " | ".join(cells) + " |")
    for side, summary in (("measured", measured), ("simulated", simulated)):
        if summary:
            lines.append(
                f"\n{side}: {summary['steps']:,} steps, {summary['stalls']} of them at least "
                f"0.5 s ({summary['stall_seconds']:.1f} s)."
            )
    return lines


def slora_markdown(report: dict) -> str:
    lines = [
        f"# S-LoRA {report['setting']} on a simulated GPU ({report['profile']})",
        "",
        f"**Simulated: {report['label']}.** S-LoRA's own trace (seed 42, its arrival, length "
        "and popularity draws; `benchmarks/common/slora_workloads.py`); throughput is S-LoRA's "
        "(finished requests over the time to the last finish). The base-model rows serve the "
        "same trace with no adapter: the ceiling. *Of the base model's*: the row's throughput "
        "over that ceiling's; *the adapters' bytes allow*: the same ratio with the steps "
        "costing the base model's time plus their adapters' bytes at full memory bandwidth "
        "(no launches, no copies): what perfect LoRA kernels would reach. Both ratios mean "
        "something only at a saturating rate: below it every run serves what arrives. "
        "Adapters at the start: "
        f"{report.get('adapters_start', 'in the store (fetched on demand)')}. Engine: the GPU "
        "presets' settings"
        + "".join(f", {k} {v:,}" for k, v in report.get("engine", {}).items())
        + ".",
        "",
        f"Command: `{report.get('command', '')}`",
        "",
        "| offered req/s | adapters | req/s | of the base model's | the adapters' bytes allow "
        "| output tok/s | TTFT P50 / P99 s | ITL P50 ms "
        "| re-loads / evictions / room waits / preemptions per min |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    base = {r["offered_rate"]: r["requests_per_s"] for r in report["rows"] if r["adapters"] is None}
    for r in report["rows"]:
        pm = r["per_minute"]
        counters = per_minute_cell(pm)
        adapters = "base model" if r["adapters"] is None else f"{r['adapters']:,}"
        ceiling = base.get(r["offered_rate"])
        of_base = "—" if ceiling is None else f"{r['requests_per_s'] / ceiling:.0%}"
        floor = r.get("adapter_floor_ratio")
        allowed = "—" if floor is None else f"{floor:.0%}"
        lines.append(
            f"| {r['offered_rate']:g} | {adapters} | {r['requests_per_s']:.2f} | {of_base} | "
            f"{allowed} | {r['output_tokens_per_s']:,.0f} | {r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | "
            f"{1e3 * r['itl_p50_s']:.1f} | {counters} |"
        )
    return "\n".join(lines) + "\n"
