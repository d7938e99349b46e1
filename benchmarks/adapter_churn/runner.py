"""``loramux bench adapter-churn``: inter-token latency under adapter churn, against the same
trace with every adapter resident.

The workload is the ``adapter-churn`` preset's (``serve/presets.py``), served greedy with
EOS suppressed in float32. Two runs on the same trace in one process, each a fresh engine
fed open-loop by the engine driver:

* **churn**: host and device tiers of about ``--host-adapters`` / ``--device-adapters``
  adapters (budgets from the adapters' real sizes), so nearly every request's adapter is
  loaded by the engine's loader thread, copied to the device and later evicted;
* **all resident**: a device pool for every adapter the trace uses, each requested once
  (untimed) before the trace.

ITL samples are the gaps between a request's consecutive tokens, pooled; the wait for an
adapter is queue time (in TTFT), not ITL. The goal: churn ITL P99 at most 1.2x the
all-resident ITL P99 (reported, not asserted). Torch gets cores - 1 threads by default,
leaving the loader a core as a GPU server's host would; ``--threads 2`` on two cores shows
the contended case.

Writes ``<out>/adapter_churn_<device>[_quick|_smoke][_threadsN].{json,md}``; the recorded
results are ``loramux bench adapter-churn`` and ``loramux bench adapter-churn --threads 2``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from loramux.benchmarks.adapter_churn.report import figures, markdown, repeat_figures
from loramux.benchmarks.common.adapter_traffic import read_counters, traffic_between
from loramux.benchmarks.common.adapters import QKVO, AdapterSpec, prepare_adapters
from loramux.benchmarks.common.drivers import run_engine
from loramux.benchmarks.common.files import add_output_options, check_output_options
from loramux.benchmarks.common.machine import Clock, available_cores, contention, machine_info
from loramux.benchmarks.common.models import prepare_model
from loramux.benchmarks.common.prompts import chat_prompts
from loramux.benchmarks.common.report import write
from loramux.benchmarks.common.workload import WorkloadRequest, WorkloadSpec, generate
from loramux.benchmarks.serve.gpu_model import SMOKE_MODEL, random_model_dir
from loramux.benchmarks.serve.presets import PRESETS

PRESET = PRESETS["adapter-churn"]
FULL = PRESET.workload
ADAPTER_DTYPE = torch.bfloat16  # on disk, like adapters trained in bf16; parsed to float32
NO_PROGRESS_SECONDS = 120.0  # a run that produces no token for this long is a hang
KINDS = ("churn", "resident")
MODES = ("full", "quick", "smoke")
# Each size option: its help, then its value in a full, a --quick and a --smoke run.
SIZES = {
    "adapters": ("registered adapters", FULL.num_adapters, 100, 40),
    "requests": ("requests in the trace", FULL.num_requests, 60, 24),
    "max_tokens": ("tokens per request", FULL.output_len[0], 16, 8),
    "host_adapters": ("churn: adapters the host tier holds", 50, 12, 6),
    "device_adapters": ("churn: adapters the device holds", 16, 6, 3),
    "rate": ("Poisson arrivals per second", FULL.rate, 2.0, 200.0),
}
COUNTS = tuple(name for name in SIZES if name != "rate")
# The options the report's config holds under their own names.
AS_GIVEN = (*COUNTS, "max_num_seqs", "seed", "repeats", "threads")


def add_options(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a small run on SmolLM2")
    mode.add_argument("--smoke", action="store_true", help="seconds, on a tiny model")
    parser.add_argument("--model", type=Path, help="HF-format model folder")
    for name, (what, full, *_) in SIZES.items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(full), help=what)
    ranks = ",".join(map(str, FULL.ranks))
    parser.add_argument("--ranks", default=ranks, help="adapter i has rank ranks[i %% n]")
    parser.add_argument("--max-num-seqs", type=int, default=PRESET.engine["max_num_seqs"])
    parser.add_argument("--seed", type=int, default=FULL.seed, help="trace and adapter seed")
    parser.add_argument("--threads", type=int, help="torch threads (default: cores - 1, min 1)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each, samples pooled")
    parser.add_argument("--device", default="cpu", help="engine device (cpu, cuda, cuda:N)")
    add_output_options(parser)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fills the sizes the mode sets and the threads; positive sizes, integer ranks."""
    check_output_options(parser, args)
    args.mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    for name, (_, *values) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, values[MODES.index(args.mode)])
    try:
        args.ranks = tuple(int(r) for r in args.ranks.split(",") if r.strip())
    except ValueError:
        parser.error("--ranks needs comma-separated integers")
    counts = [getattr(args, name) for name in COUNTS]
    if min([*counts, args.repeats, args.max_num_seqs, *args.ranks]) < 1 or args.rate <= 0:
        parser.error("sizes, --ranks, --rate, --repeats and --max-num-seqs must be positive")
    args.threads_given = args.threads is not None
    if args.threads is None:
        args.threads = max(1, available_cores() - 1)
    elif args.threads < 1:
        parser.error("--threads must be positive")


# --- setup ----------------------------------------------------------------------------------


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


def compute_budgets(args, work: Work) -> tuple[dict, dict]:
    """Each kind's engine budgets (``kv_cache_bytes``, ``adapter_device_bytes``,
    ``adapter_host_bytes``) from the adapters' real sizes (float32 on the engine), and the
    sizes they come from."""
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
    device = {
        "churn": math.ceil(max(args.device_adapters * mean_rank, max(ranks)) * bytes_per_row),
        # Every used adapter, plus one max-rank adapter of slack for row rounding.
        "resident": (used_rows + max(ranks)) * bytes_per_row,
    }
    budgets = {
        kind: {
            "kv_cache_bytes": kv_bytes + device[kind],
            "adapter_device_bytes": device[kind],
            "adapter_host_bytes": host_bytes,
        }
        for kind in KINDS
    }
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
    return budgets, sizes


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


def build_engine(args, work: Work, budgets: dict):
    from loramux.engine import Engine, EngineConfig
    from loramux.engine.lora.source import LocalDirectorySource

    engine = Engine(
        EngineConfig(
            model=str(work.model_dir),
            load_format=work.load_format,
            **budgets,
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


def run_once(kind: str, args, work: Work, budgets: dict) -> dict:
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


# --- the study ------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    script_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    machine = machine_info()
    print(f"machine: {machine}", flush=True)
    work = prepare(args)
    budgets, sizes = compute_budgets(args, work)
    print(
        f"{workload_spec(args)}; {sizes['distinct_adapters_used']} adapters used; torch "
        f"threads {args.threads}; budgets {budgets}",
        flush=True,
    )
    runs: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    each: dict[str, list[dict]] = {kind: [] for kind in KINDS}  # each run's own figures
    for repeat in range(args.repeats):
        for kind in KINDS if repeat % 2 == 0 else KINDS[::-1]:
            runs[kind].append(run_once(kind, args, work, budgets[kind]))
            f = figures(kind, runs[kind][-1:], args.max_tokens)
            each[kind].append(f)
            print(
                f"[{repeat}] {kind}: ITL P50 {f['itl']['p50_ms']} ms, P99 {f['itl']['p99_ms']} "
                f"ms; {f['tokens_per_s']} tok/s; device hits {f['adapters']['device_hits']}/"
                f"{f['requests']}, loads {f['adapters']['loads']}; cores used {f['cores_used']}",
                flush=True,
            )
    clocks = [r["clock"] for kind in KINDS for r in runs[kind]]
    busy = contention(clocks, {**machine, "torch_threads": args.threads})
    pooled = {kind: figures(kind, runs[kind], args.max_tokens) for kind in KINDS}
    ratios = repeat_figures(pooled["churn"], pooled["resident"])
    goal = PRESET.goals[0]
    report = {
        "benchmark": "adapter_churn",
        "device": torch.device(args.device).type,
        "config": {
            "mode": args.mode,
            "model": work.model_dir.name,
            **{name: getattr(args, name) for name in AS_GIVEN},
            "ranks": list(args.ranks),
            "targets": list(QKVO),
            "adapter_disk_dtype": str(ADAPTER_DTYPE).removeprefix("torch."),
            "rate_per_s": args.rate,
            "max_model_len": PRESET.engine["max_model_len"],
            "prompt_tokens": [len(work.prompts[r.index]) for r in work.requests],
            "churn_budgets": budgets["churn"],
            "resident_budgets": budgets["resident"],
            **sizes,
            "workload": workload_spec(args).to_json(),
        },
        "machine": machine,
        **pooled,
        "ratio_itl_p99": ratios["ratio_itl_p99"],
        "ratio_itl_p50": ratios["ratio_itl_p50"],
        "target_ratio": goal.value,
        "verdict_met": ratios["ratio_itl_p99"] is not None and goal.met_by(ratios["ratio_itl_p99"]),
        "per_repeat": [
            repeat_figures(c, r) for c, r in zip(each["churn"], each["resident"], strict=True)
        ],
        **busy,  # max_loadavg_1m, min_cores_used, contended
        "command": args.command_line,
        "script_seconds": round(time.perf_counter() - script_start, 1),
    }
    suffix = ("" if args.mode == "full" else f"_{args.mode}") + (
        f"_threads{args.threads}" if args.threads_given else ""
    )
    write(args.out / f"adapter_churn_{report['device']}{suffix}", report, markdown(report))
    return 0
