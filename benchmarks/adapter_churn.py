"""``loramux bench adapter-churn``: inter-token latency under adapter churn, against the same
trace with every adapter resident.

The preset's workload (``workload.generate``): 1,000 registered adapters (ranks 8/16/32 on
q/k/v/o, bf16 on disk), uniform popularity, 400 chat requests arriving as a Poisson
process at 2/s, 24 tokens each (EOS suppressed, greedy), SmolLM2-135M-Instruct in float32.
Two runs on the same trace in one process, each a fresh engine fed open-loop by the
engine driver:

* **churn**: host and device tiers of about ``--host-adapters`` / ``--device-adapters``
  adapters (budgets from the adapters' real sizes), so nearly every request's adapter is
  loaded by the engine's loader thread, copied to the device and later evicted;
* **all resident**: a device pool for every adapter the trace uses, each requested once
  (untimed) before the trace.

ITL samples are the gaps between a request's consecutive tokens, pooled; the wait for an
adapter is queue time (in TTFT), not ITL. The goal: churn ITL P99 at most 1.2x the
all-resident ITL P99 (reported, not asserted). Also per run: TTFT, queue time, tokens/s,
each tier's traffic (``adapter_traffic``), step wall times by kind and the adapters each
step served. Torch gets cores - 1 threads by default, leaving the loader a core as a GPU
server's host would; ``--threads 2`` on two cores shows the contended case.

``--quick``: 100 adapters, 60 requests; ``--smoke``: seconds on a tiny model; ``--repeats
N``: runs of each in alternating order, samples pooled. Writes
``<out>/adapter_churn_<device>[_quick|_smoke][_threadsN].{json,md}``; the recorded results
are ``loramux bench adapter-churn`` and ``loramux bench adapter-churn --threads 2``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from loramux.benchmarks.adapter_churn_report import figures, render_markdown, repeat_figures
from loramux.benchmarks.bench_gpu_model import SMOKE_MODEL, random_model_dir
from loramux.benchmarks.bench_presets import PRESETS
from loramux.benchmarks.common.adapter_traffic import read_counters, traffic_between
from loramux.benchmarks.common.adapters import QKVO, AdapterSpec, prepare_adapters
from loramux.benchmarks.common.drivers import run_engine
from loramux.benchmarks.common.files import add_output_options, check_output_options, write_report
from loramux.benchmarks.common.machine import Clock, available_cores, contention, machine_info
from loramux.benchmarks.common.models import prepare_model
from loramux.benchmarks.common.prompts import chat_prompts
from loramux.benchmarks.common.workload import WorkloadRequest, WorkloadSpec, generate

PRESET = PRESETS["adapter-churn"]
ADAPTER_DTYPE = torch.bfloat16  # on disk, like adapters trained in bf16; parsed to float32
NO_PROGRESS_SECONDS = 120.0  # a run that produces no token for this long is a hang
# Sizes per mode: adapters, requests, max tokens, host adapters, device adapters, rate.
FULL = PRESET.workload
SIZES = {
    "full": dict(
        adapters=FULL.num_adapters,
        requests=FULL.num_requests,
        max_tokens=FULL.output_len[0],
        host_adapters=50,
        device_adapters=16,
        rate=FULL.rate,
    ),
    "quick": dict(
        adapters=100, requests=60, max_tokens=16, host_adapters=12, device_adapters=6, rate=2.0
    ),
    "smoke": dict(
        adapters=40, requests=24, max_tokens=8, host_adapters=6, device_adapters=3, rate=200.0
    ),
}


@dataclass(frozen=True)
class Budgets:
    kv_cache_bytes: int
    adapter_device_bytes: int
    adapter_host_bytes: int


@dataclass
class Work:
    """What both runs serve: the model, its adapters, the trace and its prompts."""

    model_dir: Path
    load_format: str  # "random" for the smoke's weightless model
    model_config: object  # loramux.engine.model.config.ModelConfig
    adapters: list[AdapterSpec]
    requests: list[WorkloadRequest]
    prompts: dict[int, list[int]]

    def used(self) -> list[str]:
        """The adapters the trace uses, in order of first use."""
        return list(dict.fromkeys(self.adapters[r.adapter].name for r in self.requests))


# --- setup ----------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="loramux bench adapter-churn", description=__doc__.split("\n\n")[0]
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a small run on SmolLM2")
    mode.add_argument("--smoke", action="store_true", help="seconds, on a tiny model")
    parser.add_argument("--model", type=Path, help="HF-format model folder")
    for name, what in (
        ("adapters", "registered adapters"),
        ("requests", "requests in the trace"),
        ("max_tokens", "tokens per request"),
        ("host_adapters", "churn: adapters the host tier holds"),
        ("device_adapters", "churn: adapters the device holds"),
    ):
        parser.add_argument("--" + name.replace("_", "-"), type=int, help=what)
    parser.add_argument("--rate", type=float, help="Poisson arrivals per second")
    ranks = ",".join(map(str, FULL.ranks))
    parser.add_argument("--ranks", default=ranks, help="adapter i has rank ranks[i %% n]")
    parser.add_argument("--max-num-seqs", type=int, default=PRESET.engine["max_num_seqs"])
    parser.add_argument("--seed", type=int, default=FULL.seed, help="trace and adapter seed")
    parser.add_argument("--threads", type=int, help="torch threads (default: cores - 1, min 1)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each, samples pooled")
    parser.add_argument("--device", default="cpu", help="engine device (cpu, cuda, cuda:N)")
    add_output_options(parser)
    args = parser.parse_args(argv)
    check_output_options(parser, args)
    args.mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    for name, value in SIZES[args.mode].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        args.ranks = tuple(int(r) for r in args.ranks.split(",") if r.strip())
    except ValueError:
        parser.error("--ranks needs comma-separated integers")
    counts = [getattr(args, name) for name in SIZES["full"] if name != "rate"]
    if min([*counts, args.repeats, args.max_num_seqs, *args.ranks]) < 1 or args.rate <= 0:
        parser.error("sizes, --ranks, --rate, --repeats and --max-num-seqs must be positive")
    args.threads_given = args.threads is not None
    if args.threads is None:
        args.threads = max(1, available_cores() - 1)
    elif args.threads < 1:
        parser.error("--threads must be positive")
    args.command = " ".join(["loramux bench adapter-churn", *argv])
    return args


def workload_spec(args) -> WorkloadSpec:
    return dataclasses.replace(
        FULL,
        num_requests=args.requests,
        rate=args.rate,
        num_adapters=args.adapters,
        ranks=args.ranks,
        output_len=(args.max_tokens, args.max_tokens),
        seed=args.seed,
    )


def resolve_model(args) -> tuple[Path, str]:
    """The model folder and how the engine loads it."""
    if args.model is not None:
        return args.model, "safetensors"
    smollm2 = prepare_model(args.cache_dir)
    if args.mode != "smoke":
        return smollm2, "safetensors"
    # Tiny Llama shapes with SmolLM2's vocabulary (the prompts are its chat template).
    vocab = json.loads((smollm2 / "config.json").read_text())
    config = {
        **SMOKE_MODEL,
        **{k: vocab[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")},
    }
    folder = args.cache_dir / "random-models" / "llama-tiny-random-churn"
    return random_model_dir(folder, config, lambda: smollm2), "random"


def prepare(args) -> Work:
    from transformers import AutoTokenizer

    from loramux.engine.model.config import ModelConfig

    model_dir, load_format = resolve_model(args)
    spec = workload_spec(args)
    shapes = tuple((rank, QKVO) for rank in spec.ranks)
    seed = spec.seed * 100_003
    adapters = prepare_adapters(
        args.cache_dir, model_dir, shapes, spec.num_adapters, seed=seed, dtype=ADAPTER_DTYPE
    )
    prompts = chat_prompts(AutoTokenizer.from_pretrained(model_dir), spec.num_requests)
    config = ModelConfig.from_pretrained(model_dir)
    requests = generate(spec)
    return Work(model_dir, load_format, config, adapters, requests, dict(enumerate(prompts)))


def compute_budgets(args, work: Work) -> tuple[Budgets, Budgets, dict]:
    """Churn and all-resident budgets from the adapters' real sizes (float32 on the engine)."""
    from loramux.engine.memory.arena import RowLayout

    config, block_size, itemsize = work.model_config, 16, 4  # EngineConfig's block size
    layout = RowLayout.for_model(config, num_blocks=1, block_size=block_size)
    bytes_per_row = 2 * config.num_layers * layout.row_width * itemsize
    per_rank_host = config.num_layers * sum(sum(config.module_shape(m)) for m in QKVO) * itemsize
    ranks = [a.rank for a in work.adapters]
    mean_rank = sum(ranks) / len(ranks)
    kv_block_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize
    longest = max(map(len, work.prompts.values())) + args.max_tokens
    max_model_len = PRESET.engine["max_model_len"]
    kv_blocks = args.max_num_seqs * -(-longest // block_size) + -(-max_model_len // block_size)
    kv_bytes = (kv_blocks + 16) * kv_block_bytes * block_size
    used_rows = sum(a.rank for a in work.adapters if a.name in set(work.used()))
    host_bytes = math.ceil(args.host_adapters * mean_rank * per_rank_host)
    churn_device = math.ceil(max(args.device_adapters * mean_rank, max(ranks)) * bytes_per_row)
    # Every used adapter on the device, plus one max-rank adapter of slack for row rounding.
    resident_device = (used_rows + max(ranks)) * bytes_per_row
    sizes = {
        "device_bytes_per_rank_row": bytes_per_row,
        "host_bytes_per_rank": per_rank_host,
        "mean_rank": round(mean_rank, 2),
        "mean_adapter_host_bytes": round(mean_rank * per_rank_host),
        "mean_adapter_device_bytes": round(mean_rank * bytes_per_row),
        "kv_bytes": kv_bytes,
        "distinct_adapters_used": len(work.used()),
        "used_adapter_rows": used_rows,
    }
    churn = Budgets(kv_bytes + churn_device, churn_device, host_bytes)
    resident = Budgets(kv_bytes + resident_device, resident_device, host_bytes)
    return churn, resident, sizes


# --- one run --------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepRecord:
    """One ``engine.step()`` that produced tokens."""

    seconds: float
    tokens: int  # requests that got a token (the batch's decodes and finished prefills)
    first_tokens: int  # of which first tokens: the step ran those requests' prefills
    device_loads: int  # adapters copied to the device in this step


class StepRecorder:
    """The engine driver's ``step``: times each step, counts the adapters it copied to the
    device and the adapters each step's LoRA served, and stops a run that hangs."""

    def __init__(self, engine) -> None:
        self.engine, self.pool = engine, engine.lora_pool
        self.records: list[StepRecord] = []
        self.forms: Counter = Counter()
        self.last_progress = time.monotonic()
        step_table = self.pool.step_table

        def counting(spans):  # read-only wrapper: the pool's own table, counted
            table = step_table(spans)
            adapters = 0 if table is None else len(table.adapter_rows)
            self.forms[("no adapter", "one adapter", "several adapters")[min(adapters, 2)]] += 1
            return table

        self.pool.step_table = counting

    def step(self) -> list:
        resident, evictions = len(self.pool.resident_ids()), self.pool.evictions
        start = time.perf_counter()
        outputs = self.engine.step()
        seconds = time.perf_counter() - start
        if outputs:
            loaded = len(self.pool.resident_ids()) - resident + self.pool.evictions - evictions
            first = sum(len(out.token_ids) == 1 for out in outputs)
            self.records.append(StepRecord(seconds, len(outputs), first, loaded))
            self.last_progress = time.monotonic()
        elif time.monotonic() - self.last_progress > NO_PROGRESS_SECONDS:
            raise RuntimeError(f"no token for {NO_PROGRESS_SECONDS:.0f} s: the engine hangs")
        return outputs


def build_engine(args, work: Work, budgets: Budgets):
    from loramux.engine import Engine, EngineConfig
    from loramux.engine.lora.source import LocalDirectorySource

    engine = Engine(
        EngineConfig(
            model=str(work.model_dir),
            load_format=work.load_format,
            **dataclasses.asdict(budgets),
            max_num_seqs=args.max_num_seqs,
            max_model_len=PRESET.engine["max_model_len"],
            device=args.device,
            dtype="float32",
            seed=args.seed,
        )
    )
    for spec in work.adapters:
        engine.register_adapter(spec.name, LocalDirectorySource(spec.path))
    return engine


def warm_up(engine, adapter_names: list[str]) -> None:
    """Untimed: a base-model generate (torch warm-up), then one 1-token request per adapter
    in ``adapter_names`` (so the all-resident run starts with them on the device)."""
    from loramux.engine import SamplingParams

    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate(["Hello there", "Warm up"], greedy)
    one = dataclasses.replace(greedy, max_tokens=1)
    outputs = engine.generate(["Warm up"] * len(adapter_names), one, adapters=adapter_names)
    failed = [o.request_id for o in outputs if o.error]
    if failed:
        raise RuntimeError(f"warm-up requests failed: {failed[:5]}")


def run_once(kind: str, args, work: Work, budgets: Budgets) -> dict:
    """One run: a fresh engine, its warm-up, the timed trace. Records, steps, counters."""
    engine = build_engine(args, work, budgets)
    try:
        used = work.used()
        warm_up(engine, used if kind == "resident" else [])
        residency = engine.adapter_residency()
        recorder = StepRecorder(engine)
        before = read_counters(engine)
        names = [a.name for a in work.adapters]
        with Clock() as clock:
            records = run_engine(engine, work.requests, work.prompts, names, step=recorder.step)
        return {
            "records": records,
            "steps": recorder.records,
            "lora_forms": recorder.forms,
            "counters": traffic_between(before, read_counters(engine)),
            "clock": clock.summary(),
            "used_adapters_on_device_before_trace": sum(residency[n] == "device" for n in used),
        }
    finally:
        engine.close()  # stops its loader threads


# --- the command ----------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    script_start = time.perf_counter()
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_info()
    print(f"machine: {machine}", flush=True)
    work = prepare(args)
    churn_budgets, resident_budgets, sizes = compute_budgets(args, work)
    budgets = {"churn": churn_budgets, "resident": resident_budgets}
    print(
        f"{workload_spec(args)}; {sizes['distinct_adapters_used']} adapters used; torch "
        f"threads {args.threads}; budgets {budgets}",
        flush=True,
    )
    runs: dict[str, list[dict]] = {"churn": [], "resident": []}
    for repeat in range(args.repeats):
        for kind in ("churn", "resident") if repeat % 2 == 0 else ("resident", "churn"):
            runs[kind].append(run_once(kind, args, work, budgets[kind]))
            f = figures(kind, runs[kind][-1:], args.max_tokens)
            print(
                f"[{repeat}] {kind}: ITL P50 {f['itl']['p50_ms']} ms, P99 {f['itl']['p99_ms']} "
                f"ms; {f['tokens_per_s']} tok/s; device hits {f['adapters']['device_hits']}/"
                f"{f['requests']}, loads {f['adapters']['loads']}; cores used {f['cores_used']}",
                flush=True,
            )
    report = build_report(args, work, machine, runs, budgets, sizes)
    report["script_seconds"] = round(time.perf_counter() - script_start, 1)
    suffix = ("" if args.mode == "full" else f"_{args.mode}") + (
        f"_threads{args.threads}" if args.threads_given else ""
    )
    stem = args.out / f"adapter_churn_{report['device']}{suffix}"
    write_report(stem, report, render_markdown(report))
    return 0


def build_report(args, work: Work, machine: dict, runs: dict, budgets: dict, sizes: dict) -> dict:
    churn = figures("churn", runs["churn"], args.max_tokens)
    resident = figures("resident", runs["resident"], args.max_tokens)
    clocks = [run["clock"] for kind in runs.values() for run in kind]
    busy = contention(clocks, {**machine, "torch_threads": args.threads})
    per_repeat = [
        repeat_figures(
            figures("churn", [c], args.max_tokens), figures("resident", [r], args.max_tokens)
        )
        for c, r in zip(runs["churn"], runs["resident"], strict=True)
    ]
    ratios = repeat_figures(churn, resident)
    goal = PRESET.goals[0]
    return {
        "benchmark": "adapter_churn",
        "device": torch.device(args.device).type,
        "config": {
            "mode": args.mode,
            "model": work.model_dir.name,
            "adapters": args.adapters,
            "ranks": list(args.ranks),
            "targets": list(QKVO),
            "adapter_disk_dtype": str(ADAPTER_DTYPE).removeprefix("torch."),
            "requests": args.requests,
            "rate_per_s": args.rate,
            "max_tokens": args.max_tokens,
            "host_adapters": args.host_adapters,
            "device_adapters": args.device_adapters,
            "max_num_seqs": args.max_num_seqs,
            "max_model_len": PRESET.engine["max_model_len"],
            "seed": args.seed,
            "repeats": args.repeats,
            "threads": args.threads,
            "prompt_tokens": [len(work.prompts[r.index]) for r in work.requests],
            "churn_budgets": dataclasses.asdict(budgets["churn"]),
            "resident_budgets": dataclasses.asdict(budgets["resident"]),
            **sizes,
            "workload": workload_spec(args).to_json(),
        },
        "machine": machine,
        "churn": churn,
        "resident": resident,
        "ratio_itl_p99": ratios["ratio_itl_p99"],
        "ratio_itl_p50": ratios["ratio_itl_p50"],
        "target_ratio": goal.value,
        "verdict_met": ratios["ratio_itl_p99"] is not None and goal.met_by(ratios["ratio_itl_p99"]),
        "per_repeat": per_repeat,
        "max_loadavg_1m": busy["max_loadavg_1m"],
        "min_cores_used": busy["min_cores_used"],
        "contended": busy["contended"],
        "command": args.command,
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
