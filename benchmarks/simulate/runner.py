"""``loramux bench simulate``: S-LoRA's workloads and the recorded GPU runs served by the
real engine on a simulated GPU (``serve.py``).

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
from dataclasses import fields
from pathlib import Path

from loramux.benchmarks.common.files import RESULTS_DIR, add_output_options
from loramux.benchmarks.common.models import prepare_model
from loramux.benchmarks.common.report import write
from loramux.benchmarks.common.slora_workloads import SETTINGS, TABLE_ADAPTERS
from loramux.benchmarks.simulate.churn import (
    CHURN_DURATION_S,
    CHURN_FACTORS,
    DEFAULT_CAPACITY,
    churn_markdown,
    churn_plot,
    churn_sweep,
)
from loramux.benchmarks.simulate.runs import (
    calibration,
    calibration_markdown,
    slora_markdown,
    slora_table,
)
from loramux.benchmarks.simulate.serve import DEFAULT_PROFILE
from loramux.engine.config import EngineConfig
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
    name, _, value = text.partition("=")
    if name not in {f.name for f in fields(EngineConfig)}:
        raise argparse.ArgumentTypeError(f"{name!r} is not an engine setting (EngineConfig field)")
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the value must be a number") from None
    return name, int(number) if number.is_integer() else number


def add_options(parser: argparse.ArgumentParser) -> None:
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


def run(args: argparse.Namespace) -> int:
    profile = DeviceProfile.load(resolve_profile(args.profile))
    tokenizer = prepare_model(args.cache_dir)  # SmolLM2's tokenizer ids decode Llama's
    args.out.mkdir(parents=True, exist_ok=True)
    head = {"command": args.command_line}
    if args.what == "calibrate":
        report = head | calibration(profile, args.cache_dir, tokenizer, args.recorded, args.suffix)
        stem = args.out / f"simulation_calibration_{profile.name}{args.suffix}"
        write(stem, report, calibration_markdown(report))
        return 0
    rates = args.rates or [SETTINGS[args.setting].rate]
    if args.what == "churn":
        report = head | churn_sweep(
            args.setting,
            profile,
            args.cache_dir,
            tokenizer,
            capacity=args.capacity,
            factors=tuple(args.factors),
            rate=rates[0],
            duration_s=args.duration or CHURN_DURATION_S,
        )
        stem = args.out / f"simulation_churn-{args.setting}-{rates[0]:g}rps_{profile.name}"
        plot = churn_plot(report, stem.with_suffix(".png"))
        write(stem, report, churn_markdown(report, plot))
        return 0
    report = head | slora_table(
        args.setting,
        profile,
        args.cache_dir,
        tokenizer,
        args.adapters,
        rates,
        args.duration,
        args.host_resident,
        dict(args.engine),
    )
    where = "-host" if args.host_resident else ""
    where += "".join(f"-{name}={value}" for name, value in args.engine)
    offered = "-".join(f"{r:g}" for r in rates)
    stem = args.out / f"simulation_slora-{args.setting}{where}-{offered}rps_{profile.name}"
    write(stem, report, slora_markdown(report))
    return 0
