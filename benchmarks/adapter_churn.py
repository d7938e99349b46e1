"""Inter-token latency under adapter churn, against the same trace with every adapter resident.

The issue's benchmark: 1,000 registered LoRA adapters with uniform popularity, requests
arriving over time, each for a random adapter. Two runs in the same process, one after
the other, on the same request trace (same arrival times, prompts and adapters):

* **churn**: the host-RAM tier holds about ``--host-adapters`` adapters and the device
  pool about ``--device-adapters`` (budgets set from the adapters' real sizes), so nearly
  every request's adapter is loaded from disk by the engine's background loader thread,
  copied to the device, and evicted again later;
* **all resident**: the same engine settings but a device budget that holds every
  adapter the trace uses; each of them is requested once (untimed) before the trace, so
  every request finds its adapter on the device.

Requests arrive as a Poisson process at ``--rate`` requests/s into a step loop: before
each ``step()`` the loop adds the requests whose arrival time has come. Each request
generates exactly ``--max-tokens`` tokens (EOS suppressed, greedy). The inter-token
latency (ITL) samples are the gaps between consecutive tokens of the same request
(``RequestMetrics.inter_token_times``), pooled over all requests; a request's wait for
its adapter is queue time (in TTFT), not ITL. The target: churn ITL P99 at most 1.2x the
all-resident ITL P99 (reported, not asserted).

Threads: the loader thread parses adapters on the CPU while the step loop runs. On a
CPU-only machine it competes with torch's compute threads for the cores, which a GPU
server (compute on the GPU, loads on spare host cores) does not see. By default torch
gets ``cores - 1`` threads in *both* runs, leaving one core for the loader thread, so
the ratio measures the engine's churn cost rather than this machine's core count;
``--threads`` overrides it (``--threads 2`` on two cores shows the contended case).

    .venv/bin/python benchmarks/adapter_churn.py            # full size (several minutes)
    .venv/bin/python benchmarks/adapter_churn.py --quick    # 100 adapters, 60 requests
    .venv/bin/python benchmarks/adapter_churn.py --smoke --model DIR  # seconds, tiny model
    .venv/bin/python benchmarks/adapter_churn.py --repeats 2  # alternating runs, pooled

Adapters are PEFT-format folders written directly (random bf16 A/B tensors under PEFT's
names, ranks cycling through ``--ranks``, q/k/v/o targets), cached under
``.loramux/bench-cache/churn-adapters/`` keyed by the model and the seed. The "store" is
that local folder; the OS page cache probably holds the files after they are written,
so a load costs the parse (safetensors read, bf16 -> float32, validation), not a disk
read. Writes ``benchmarks/results/adapter_churn_<device>[_quick|_smoke][_threadsN].{json,md}``
(``_threadsN`` when ``--threads`` is given).
"""

from __future__ import annotations

import argparse
import collections
import gc
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
sys.path.insert(0, str(REPO_ROOT))

from engine_vs_peft import (  # noqa: E402 (the sibling benchmark's shared helpers)
    QUESTIONS,
    Clock,
    machine_info,
    prepare_model,
    write_atomic,
)

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
TARGET_RATIO = 1.2  # churn ITL P99 / all-resident ITL P99, at most
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
ADAPTER_STD = 0.02  # init std of A and B (alpha = 2r): visible but not model-destroying
ADAPTER_DTYPE = torch.bfloat16  # on disk, like adapters trained in bf16; parsed to float32
ENGINE_DTYPE = torch.float32
MAX_MODEL_LEN = 512  # the prompts are < 100 tokens: keeps KV's floor small
NO_PROGRESS_SECONDS = 120.0  # a run that produces no token for this long is a hang

# Sizes per mode: adapters, requests, max tokens, host adapters, device adapters, rate.
SIZES = {
    "full": dict(adapters=1000, requests=400, max_tokens=24, host=50, device=16, rate=2.0),
    "quick": dict(adapters=100, requests=60, max_tokens=16, host=12, device=6, rate=2.0),
    "smoke": dict(adapters=40, requests=24, max_tokens=8, host=6, device=3, rate=200.0),
}


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: Path
    rank: int


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    arrival: float  # seconds after the run's start
    prompt: list[int]
    adapter: str


@dataclass(frozen=True)
class Budgets:
    kv_cache_bytes: int
    adapter_device_bytes: int
    adapter_host_bytes: int

    def summary(self) -> dict:
        return {
            "kv_cache_bytes": self.kv_cache_bytes,
            "adapter_device_bytes": self.adapter_device_bytes,
            "adapter_host_bytes": self.adapter_host_bytes,
        }


# --- setup ---------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a small run on SmolLM2")
    mode.add_argument(
        "--smoke",
        action="store_true",
        help="seconds: a tiny random model (--model, or one built into the cache)",
    )
    parser.add_argument("--model", type=Path, default=None, help="HF-format model directory")
    parser.add_argument("--adapters", type=int, default=None, help="registered adapters")
    parser.add_argument("--requests", type=int, default=None, help="requests in the trace")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per request")
    parser.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second")
    parser.add_argument(
        "--host-adapters", type=int, default=None, help="churn: adapters the host tier holds"
    )
    parser.add_argument(
        "--device-adapters", type=int, default=None, help="churn: adapters the device holds"
    )
    parser.add_argument("--ranks", default="8,16,32", help="adapter i has rank ranks[i %% n]")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="engine max_num_seqs")
    parser.add_argument("--seed", type=int, default=0, help="trace and adapter seed")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: cores - 1, min 1)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each mode (alternating which goes first); ITL samples are pooled",
    )
    parser.add_argument("--device", default="cpu", help="engine device (cpu, cuda, cuda:N)")
    parser.add_argument(
        "--out", type=Path, default=RESULTS_DIR, help="output folder (default benchmarks/results)"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=REPO_ROOT / ".loramux" / "bench-cache",
        help="where the converted model and the adapters are cached",
    )
    args = parser.parse_args(argv)
    args.mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    sizes = SIZES[args.mode]
    for arg, key in (
        ("adapters", "adapters"),
        ("requests", "requests"),
        ("max_tokens", "max_tokens"),
        ("host_adapters", "host"),
        ("device_adapters", "device"),
        ("rate", "rate"),
    ):
        if getattr(args, arg) is None:
            setattr(args, arg, sizes[key])
    try:
        args.ranks = tuple(int(r) for r in args.ranks.split(",") if r.strip())
    except ValueError:
        parser.error("--ranks needs comma-separated integers")
    positive = ("adapters", "requests", "max_tokens", "host_adapters", "device_adapters")
    if any(getattr(args, name) < 1 for name in positive) or not args.ranks:
        parser.error(f"--{', --'.join(p.replace('_', '-') for p in positive)} must be positive")
    if min(args.ranks) < 1 or args.rate <= 0 or args.repeats < 1 or args.max_num_seqs < 1:
        parser.error("--ranks, --rate, --repeats and --max-num-seqs must be positive")
    args.threads_given = args.threads is not None
    if args.threads is None:
        args.threads = max(1, available_cores() - 1)
    elif args.threads < 1:
        parser.error("--threads must be positive")
    return args


def available_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def resolve_model(args) -> Path:
    if args.model is not None:
        return args.model
    smollm2 = prepare_model(args.cache_dir)
    if args.mode != "smoke":
        return smollm2
    from tests.fixtures.models import build_tiny_model

    tiny = args.cache_dir / "tiny-llama-seed0"
    if not (tiny / "config.json").is_file():
        staging = tiny.with_name(f"{tiny.name}.partial-{uuid.uuid4().hex[:8]}")
        build_tiny_model(staging, smollm2)
        _publish(staging, tiny)
    return tiny


def _publish(staging: Path, final: Path) -> None:
    """Rename a finished staging folder into place; if another process won, drop ours."""
    try:
        staging.rename(final)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not final.is_dir():
            raise


def model_key(model_dir: Path) -> str:
    digest = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:10]
    return f"{model_dir.name}-{digest}"


def _module_prefix(layer: int, module: str) -> str:
    part = "mlp" if module in MLP_MODULES else "self_attn"
    return f"base_model.model.model.layers.{layer}.{part}.{module}"


def write_adapter(path: Path, model_dir: Path, model_config, rank: int, seed: int) -> None:
    """A PEFT-format adapter (no PEFT needed): config + random A/B tensors, all layers."""
    from safetensors.torch import save_file

    from loramux.engine.lora.adapter import CONFIG_FILE, WEIGHTS_FILE

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_layers):
        for module in QKVO:
            in_features, out_features = model_config.module_shape(module)
            prefix = _module_prefix(layer, module)
            a = torch.randn(rank, in_features, generator=generator) * ADAPTER_STD
            b = torch.randn(out_features, rank, generator=generator) * ADAPTER_STD
            tensors[f"{prefix}.lora_A.weight"] = a.to(ADAPTER_DTYPE)
            tensors[f"{prefix}.lora_B.weight"] = b.to(ADAPTER_DTYPE)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(QKVO),
        "bias": "none",
        "use_rslora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    staging = path.with_name(f"{path.name}.partial-{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
    (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    _publish(staging, path)


def prepare_adapters(args, model_dir: Path, model_config) -> list[AdapterSpec]:
    """``--adapters`` adapters, written once and cached per model, ranks and seed."""
    from loramux.engine.lora.adapter import WEIGHTS_FILE

    ranks = "-".join(map(str, args.ranks))
    folder = (
        args.cache_dir
        / "churn-adapters"
        / f"{model_key(model_dir)}-r{ranks}-qkvo-bf16-std{ADAPTER_STD}-seed{args.seed}"
    )
    specs, built, start = [], 0, time.perf_counter()
    for i in range(args.adapters):
        rank = args.ranks[i % len(args.ranks)]
        path = folder / f"a{i:04d}"
        if not (path / WEIGHTS_FILE).is_file():
            write_adapter(path, model_dir, model_config, rank, seed=args.seed * 100_003 + i)
            built += 1
            if built % 100 == 0:
                print(f"  built {built} adapters ...", flush=True)
        specs.append(AdapterSpec(f"a{i:04d}", path, rank))
    if built:
        print(f"built {built} adapters in {time.perf_counter() - start:.1f} s", flush=True)
    return specs


def make_trace(args, tokenizer, adapters: list[AdapterSpec]) -> list[TraceRequest]:
    """Poisson arrivals, uniform adapter popularity, chat-templated prompts: seeded."""
    rng = random.Random(args.seed)
    trace, clock = [], 0.0
    for i in range(args.requests):
        question = QUESTIONS[i % len(QUESTIONS)]
        if i >= len(QUESTIONS):
            question = f"{question} (Answer #{i // len(QUESTIONS) + 1}.)"
        trace.append(
            TraceRequest(
                request_id=f"req-{i:05d}",
                arrival=clock,
                prompt=_prompt_ids(tokenizer, question),
                adapter=adapters[rng.randrange(len(adapters))].name,
            )
        )
        clock += rng.expovariate(args.rate)
    return trace


def _prompt_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except ValueError:  # a tokenizer without a chat template
        text = question
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# --- budgets -------------------------------------------------------------------------
def compute_budgets(args, model_config, adapters, trace) -> tuple[Budgets, Budgets, dict]:
    """Churn and all-resident budgets from the adapters' real sizes (engine dtype)."""
    from loramux.engine.lora.device_arena import RowLayout

    block_size = 16  # EngineConfig's default
    itemsize = ENGINE_DTYPE.itemsize
    layout = RowLayout.for_model(model_config, num_blocks=1, block_size=block_size)
    bytes_per_row = 2 * model_config.num_layers * layout.row_width * itemsize
    per_rank_host = (
        model_config.num_layers * sum(sum(model_config.module_shape(m)) for m in QKVO) * itemsize
    )
    ranks = [a.rank for a in adapters]
    mean_rank = sum(ranks) / len(ranks)
    kv_block_bytes = (
        (2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim)
        * itemsize
        * block_size
    )
    longest = max(len(r.prompt) for r in trace) + args.max_tokens
    kv_blocks = args.max_num_seqs * -(-longest // block_size) + -(-MAX_MODEL_LEN // block_size)
    kv_bytes = (kv_blocks + 16) * kv_block_bytes

    rank_of = {a.name: a.rank for a in adapters}
    used = sorted({r.adapter for r in trace})
    used_rows = sum(rank_of[name] for name in used)
    host_bytes = math.ceil(args.host_adapters * mean_rank * per_rank_host)
    churn_device = math.ceil(max(args.device_adapters * mean_rank, max(ranks)) * bytes_per_row)
    # Every used adapter on the device, plus one max-rank adapter of slack for row rounding.
    resident_device = (used_rows + max(ranks)) * bytes_per_row
    churn = Budgets(kv_bytes + churn_device, churn_device, host_bytes)
    resident = Budgets(kv_bytes + resident_device, resident_device, host_bytes)
    sizes = {
        "device_bytes_per_rank_row": bytes_per_row,
        "host_bytes_per_rank": per_rank_host,
        "mean_rank": round(mean_rank, 2),
        "mean_adapter_host_bytes": round(mean_rank * per_rank_host),
        "mean_adapter_device_bytes": round(mean_rank * bytes_per_row),
        "kv_bytes": kv_bytes,
        "distinct_adapters_used": len(used),
        "used_adapter_rows": used_rows,
    }
    return churn, resident, sizes


# --- one run -------------------------------------------------------------------------
def build_engine(args, model_dir: Path, budgets: Budgets, adapters: list[AdapterSpec]):
    from loramux.engine import Engine, EngineConfig
    from loramux.engine.lora.source import LocalDirectorySource

    engine = Engine(
        EngineConfig(
            model=str(model_dir),
            kv_cache_bytes=budgets.kv_cache_bytes,
            adapter_device_bytes=budgets.adapter_device_bytes,
            adapter_host_bytes=budgets.adapter_host_bytes,
            max_num_seqs=args.max_num_seqs,
            max_model_len=MAX_MODEL_LEN,
            device=args.device,
            dtype="float32",
            seed=args.seed,
        )
    )
    for spec in adapters:
        engine.register_adapter(spec.name, LocalDirectorySource(spec.path))
    return engine


def warm_up(engine, adapter_names: list[str]) -> None:
    """Untimed: a base-model generate (torch warm-up), then one 1-token request per adapter
    in ``adapter_names`` (so the all-resident run starts with them on the device)."""
    from loramux.engine import SamplingParams

    engine.generate(
        ["Hello there", "Warm up"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for name in adapter_names:  # unrelated prompt: no prefix-cache hits for the trace
        engine.add_request(f"warm-{name}", "Warm up", one, adapter=name)
    failed = []
    while engine.has_unfinished_requests():
        failed += [o.request_id for o in engine.step() if o.finished and o.error]
    if failed:
        raise RuntimeError(f"warm-up requests failed: {failed[:5]}")


# What the runs read from the engine's Prometheus registry: (key, sample name, labels).
COUNTERS = (
    ("device_hits", "loramux_adapter_hits_total", (("tier", "device"),)),
    ("device_misses", "loramux_adapter_misses_total", (("tier", "device"),)),
    ("host_hits", "loramux_adapter_hits_total", (("tier", "host"),)),
    ("host_misses", "loramux_adapter_misses_total", (("tier", "host"),)),
    ("loads", "loramux_adapter_loads_total", ()),
    ("device_evictions", "loramux_adapter_evictions_total", (("tier", "device"),)),
    ("host_evictions", "loramux_adapter_evictions_total", (("tier", "host"),)),
    ("load_seconds_sum", "loramux_adapter_load_seconds_sum", ()),
    ("load_seconds_count", "loramux_adapter_load_seconds_count", ()),
    ("preemptions", "loramux_preemptions_total", ()),
)


def read_counters(engine) -> dict[str, float]:
    registry = engine.metrics.registry
    return {
        key: registry.get_sample_value(sample, dict(labels)) or 0.0
        for key, sample, labels in COUNTERS
    }


@dataclass(frozen=True)
class StepRecord:
    """One ``engine.step()`` that produced tokens."""

    seconds: float
    tokens: int  # requests that got a token (the batch's decodes and finished prefills)
    first_tokens: int  # of which first tokens: the step ran those requests' prefills
    device_loads: int  # adapters copied to the device in this step


def run_trace(engine, trace: list[TraceRequest], max_tokens: int) -> dict:
    """Feed the trace at its arrival times into a step loop; per-request and per-step data.

    The loop adds every request whose arrival time has come, then steps. Latencies are
    taken from the trace's arrival times, so a request added late (the loop was inside a
    step when it arrived) still counts its wait.
    """
    from loramux.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
    pool = engine.lora_pool
    forms = _count_lora_forms(pool)
    pending = list(reversed(trace))  # pop() from the end = earliest first
    final, steps, add_lag = {}, [], 0.0
    start = time.monotonic()
    last_progress = start
    while pending or engine.has_unfinished_requests():
        now = time.monotonic()
        while pending and start + pending[-1].arrival <= now:
            r = pending.pop()
            engine.add_request(r.request_id, r.prompt, params, adapter=r.adapter)
            add_lag = max(add_lag, now - (start + r.arrival))
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + pending[-1].arrival - time.monotonic()))
            continue
        resident, evictions = len(pool.resident_ids()), pool.evictions
        t0 = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - t0
        if outputs:
            loaded = len(pool.resident_ids()) - resident + pool.evictions - evictions
            first = sum(len(out.token_ids) == 1 for out in outputs)
            steps.append(StepRecord(seconds, len(outputs), first, loaded))
            last_progress = time.monotonic()
        elif time.monotonic() - last_progress > NO_PROGRESS_SECONDS:
            raise RuntimeError(f"no token for {NO_PROGRESS_SECONDS:.0f} s: the engine hangs")
        for out in outputs:
            if out.finished:
                final[out.request_id] = out
    wall = time.monotonic() - start

    itl, ttft, queue, failed = [], [], [], 0
    for r in trace:
        out = final[r.request_id]
        if out.error is not None or len(out.token_ids) != max_tokens:
            failed += 1
        m, arrived = out.metrics, start + r.arrival
        itl += m.inter_token_times
        if m.first_token_time is not None:
            ttft.append(m.first_token_time - arrived)
        if m.first_scheduled_time is not None:
            queue.append(m.first_scheduled_time - arrived)
    return {
        "requests": len(final),
        "failed_or_short": failed,
        "tokens": sum(len(out.token_ids) for out in final.values()),
        "seconds": wall,
        "itl": itl,
        "ttft": ttft,
        "queue": queue,
        "steps": steps,
        "lora_forms": collections.Counter(forms),
        "max_arrival_lag": add_lag,
    }


def _count_lora_forms(pool) -> collections.Counter:
    """Count the adapters of each step (read-only wrapper around ``pool.step_table``).

    Steps with one adapter or none cost the torch backend nothing extra to set up; steps
    with several serve their decodes from stacked weights, copied again only when the set
    of adapters decoding together changes (the backend's ``stacks.builds``).
    """
    forms: collections.Counter = collections.Counter()
    step_table = pool.step_table

    def counting(spans):
        table = step_table(spans)
        if table is None:
            forms["no adapter"] += 1
        elif len(table.adapter_rows) > 1:
            forms["several adapters"] += 1
        else:
            forms["one adapter"] += 1
        return table

    pool.step_table = counting
    return forms


def run_mode(mode: str, args, model_dir, adapters, trace, budgets: Budgets) -> dict:
    """One run: a fresh engine, its warm-up, the timed trace. Raw samples and counters."""
    used = list(dict.fromkeys(r.adapter for r in trace))  # in order of first use
    engine = build_engine(args, model_dir, budgets, adapters)
    warm_up(engine, used if mode == "resident" else [])
    residency = engine.adapter_residency()
    on_device_before = sum(residency[name] == "device" for name in used)
    before = read_counters(engine)
    with Clock() as clock:
        raw = run_trace(engine, trace, args.max_tokens)
    after = read_counters(engine)
    raw["counters"] = {key: after[key] - before[key] for key in before}
    raw["clock"] = clock.summary()
    raw["used_adapters_on_device_before_trace"] = on_device_before
    engine.close()  # stop its loader threads
    del engine
    gc.collect()
    return raw


# --- figures -------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


def distribution(values: list[float]) -> dict:
    """P50/P90/P99/max/mean in milliseconds, and the sample count."""
    return {
        "p50_ms": _ms(percentile(values, 50)),
        "p90_ms": _ms(percentile(values, 90)),
        "p99_ms": _ms(percentile(values, 99)),
        "max_ms": _ms(max(values)) if values else None,
        "mean_ms": _ms(sum(values) / len(values)) if values else None,
        "samples": len(values),
    }


def figures(mode: str, runs: list[dict]) -> dict:
    """A mode's figures from one or more runs of it (samples pooled, counters summed)."""
    pooled = {key: [x for r in runs for x in r[key]] for key in ("itl", "ttft", "queue", "steps")}
    counters = {key: sum(r["counters"][key] for r in runs) for key in runs[0]["counters"]}
    steps: list[StepRecord] = pooled["steps"]
    tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
    clocks = [r["clock"] for r in runs]
    return {
        "mode": mode,
        "runs": len(runs),
        "requests": sum(r["requests"] for r in runs),
        "failed_or_short": sum(r["failed_or_short"] for r in runs),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 2),
        "itl": distribution(pooled["itl"]),
        "ttft": distribution(pooled["ttft"]),
        "queue": distribution(pooled["queue"]),
        "steps": {
            "count": len(steps),
            "mean_batch": round(sum(s.tokens for s in steps) / len(steps), 2) if steps else None,
            "all": distribution([s.seconds for s in steps]),
            "decode_only": distribution([s.seconds for s in steps if not s.first_tokens]),
            "with_prefill": distribution([s.seconds for s in steps if s.first_tokens]),
            "with_device_load": distribution([s.seconds for s in steps if s.device_loads]),
            "device_loads": sum(s.device_loads for s in steps),
        },
        "lora_forms": dict(sum((r["lora_forms"] for r in runs), collections.Counter())),
        "adapters": _adapter_figures(counters),
        "used_adapters_on_device_before_trace": min(
            r["used_adapters_on_device_before_trace"] for r in runs
        ),
        "preemptions": int(counters["preemptions"]),
        "max_arrival_lag_ms": _ms(max(r["max_arrival_lag"] for r in runs)),
        "cores_used": min(c["cores_used"] for c in clocks),
        "cpu_seconds": round(sum(c["cpu_seconds"] for c in clocks), 2),
        "loadavg_1m_max": max(max(c["loadavg_1m_before"], c["loadavg_1m_after"]) for c in clocks),
    }


def _adapter_figures(c: dict) -> dict:
    device_lookups = c["device_hits"] + c["device_misses"]
    host_lookups = c["host_hits"] + c["host_misses"]
    count = c["load_seconds_count"]
    return {
        "device_hits": int(c["device_hits"]),
        "device_misses": int(c["device_misses"]),
        "device_hit_rate": round(c["device_hits"] / device_lookups, 4) if device_lookups else None,
        "host_hits": int(c["host_hits"]),
        "host_misses": int(c["host_misses"]),
        "host_hit_rate": round(c["host_hits"] / host_lookups, 4) if host_lookups else None,
        "loads": int(c["loads"]),
        "device_evictions": int(c["device_evictions"]),
        "host_evictions": int(c["host_evictions"]),
        "load_ms_mean": _ms(c["load_seconds_sum"] / count) if count else None,
    }


# --- reporting -------------------------------------------------------------------------
def render_markdown(report: dict) -> str:
    cfg, m = report["config"], report["machine"]
    churn, resident = report["churn"], report["resident"]
    both = (("churn", churn), ("all resident", resident))
    title = {"full": "", "quick": " (quick run)", "smoke": " (smoke run: times mean nothing)"}
    lines = [
        f"# Inter-token latency under adapter churn, {report['device']}{title[cfg['mode']]}",
        "",
        f"{cfg['model']}, {cfg['adapters']} registered adapters (ranks "
        f"{'/'.join(map(str, cfg['ranks']))}, q/k/v/o, bf16 on disk), uniform popularity: "
        f"{cfg['requests']} requests arriving as a Poisson process at {cfg['rate_per_s']:g}/s, "
        f"{cfg['max_tokens']} tokens each (EOS suppressed, greedy, float32), "
        f"{cfg['distinct_adapters_used']} distinct adapters used. Both runs in the same "
        "process on the same trace"
        + (f", {cfg['repeats']} runs of each, samples pooled." if cfg["repeats"] > 1 else "."),
        "",
        f"- **churn**: host tier ~{cfg['host_adapters']} adapters "
        f"({_mib(cfg['churn_budgets']['adapter_host_bytes'])}), device pool "
        f"~{cfg['device_adapters']} adapters "
        f"({_mib(cfg['churn_budgets']['adapter_device_bytes'])}); cold adapters load from "
        "the local adapter folder on the engine's background loader thread.",
        f"- **all resident**: a device pool for every used adapter "
        f"({_mib(cfg['resident_budgets']['adapter_device_bytes'])}); each was requested "
        "once before the trace (untimed, in order of first use, which packs adapters used "
        "at about the same time next to each other).",
        "",
        "| run | ITL P50 ms | ITL P90 ms | ITL P99 ms | ITL max ms | TTFT P50 ms | "
        "TTFT P99 ms | queue P50 ms | queue P99 ms | tokens/s | device hits | host hits | "
        "loads | evictions device/host | cores used |",
        "|---|" + "---:|" * 14,
    ]
    for label, run in both:
        a = run["adapters"]
        lines.append(
            f"| {label} | {run['itl']['p50_ms']} | {run['itl']['p90_ms']} | "
            f"{run['itl']['p99_ms']} | {run['itl']['max_ms']} | {run['ttft']['p50_ms']} | "
            f"{run['ttft']['p99_ms']} | {run['queue']['p50_ms']} | {run['queue']['p99_ms']} | "
            f"{run['tokens_per_s']} | {a['device_hits']}/{a['device_hits'] + a['device_misses']}"
            f" | {a['host_hits']}/{a['host_hits'] + a['host_misses']} | {a['loads']} | "
            f"{a['device_evictions']}/{a['host_evictions']} | {run['cores_used']} |"
        )
    verdict = "met" if report["verdict_met"] else "not met"
    lines += [
        "",
        f"**Verdict: churn ITL P99 / all-resident ITL P99 = {report['ratio_itl_p99']:.3f}x "
        f"(target <= {report['target_ratio']:g}x): {verdict}.** "
        f"(P50 ratio {report['ratio_itl_p50']:.3f}x.)",
        "",
        "Engine steps that produced tokens, wall ms, P50 / P99 (count):",
        "",
        "| run | mean batch | all steps | decode only | with a prefill | with a device load |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, run in both:
        st = run["steps"]
        lines.append(
            f"| {label} | {st['mean_batch']} | {_dist(st['all'])} | {_dist(st['decode_only'])} "
            f"| {_dist(st['with_prefill'])} | {_dist(st['with_device_load'])} |"
        )
    forms = "; ".join(
        f"{label}: " + ", ".join(f"{k} {v}" for k, v in sorted(run["lora_forms"].items()))
        for label, run in both
    )
    lines += [
        "",
        f"Adapter loads on the loader thread (fetch + parse into float32): mean "
        f"{churn['adapters']['load_ms_mean']} ms. Preemptions: churn {churn['preemptions']}, "
        f"all resident {resident['preemptions']}. LoRA form of the steps: {forms}.",
        "",
        f"Threads: torch uses {m['torch_threads']} of {m['nproc']} cores in both runs"
        + (
            ", leaving a core for the adapter loader thread (on a GPU server loads run on "
            "host cores beside the GPU's compute; here they would otherwise take the "
            "compute threads' cores)."
            if m["torch_threads"] < m["nproc"]
            else ", so the adapter loader thread competes with them for the cores in the churn run."
        )
        + " *cores used* = this process's CPU seconds / wall seconds during the trace, "
        "loader thread included. Latencies are measured from each request's arrival time "
        "in the trace.",
    ]
    if report["contended"]:
        lines += [
            "",
            "**Warning: the machine was busy during the runs** (1-minute load average up to "
            f"{report['max_loadavg_1m']} on {m['nproc']} cores, this process's own threads "
            "included); latencies are noisier than on an idle machine.",
        ]
    if cfg["repeats"] > 1:
        lines += [
            "",
            "Per repeat, ITL P99 churn / all resident ms (ratio): "
            + "; ".join(
                f"{r['churn_itl_p99_ms']} / {r['resident_itl_p99_ms']} ({r['ratio_itl_p99']}x)"
                for r in report["per_repeat"]
            )
            + ".",
        ]
    lines += [
        "",
        f"Machine: {m['cpu_model'] or m['processor']}, {m['nproc']} cores "
        f"(torch threads {m['torch_threads']}), {m['mem_total_gib']} GiB, {m['uname']}; "
        f"Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}. "
        f"Date {m['date']}. Whole script {report['script_seconds']:.0f} s.",
        "",
        f"Command: `{report['command']}`",
        "",
    ]
    return "\n".join(lines)


def _mib(nbytes: int) -> str:
    mib = nbytes / 1024**2
    return f"{mib:.0f} MiB" if mib >= 10 else f"{mib:.2f} MiB"


def _dist(d: dict) -> str:
    return f"{d['p50_ms']} / {d['p99_ms']} ({d['samples']})"


def _repeat_figures(churn_run: dict, resident_run: dict) -> dict:
    churn, resident = figures("churn", [churn_run]), figures("resident", [resident_run])
    return {
        "churn_itl_p50_ms": churn["itl"]["p50_ms"],
        "churn_itl_p99_ms": churn["itl"]["p99_ms"],
        "resident_itl_p50_ms": resident["itl"]["p50_ms"],
        "resident_itl_p99_ms": resident["itl"]["p99_ms"],
        "ratio_itl_p99": _ratio(churn["itl"]["p99_ms"], resident["itl"]["p99_ms"]),
        "churn_cores_used": churn["cores_used"],
        "resident_cores_used": resident["cores_used"],
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 4)


def main(argv: list[str] | None = None) -> int:
    script_start = time.perf_counter()
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from loramux.engine.model.config import ModelConfig

    machine = machine_info()
    print(f"machine: {machine}", flush=True)
    model_dir = resolve_model(args)
    model_config = ModelConfig.from_pretrained(model_dir)
    adapters = prepare_adapters(args, model_dir, model_config)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trace = make_trace(args, tokenizer, adapters)
    churn_budgets, resident_budgets, sizes = compute_budgets(args, model_config, adapters, trace)
    print(
        f"{args.requests} requests at {args.rate:g}/s over {args.adapters} adapters "
        f"({sizes['distinct_adapters_used']} used), {args.max_tokens} tokens each; "
        f"torch threads {torch.get_num_threads()}; budgets churn {churn_budgets.summary()}, "
        f"resident {resident_budgets.summary()}",
        flush=True,
    )

    runs: dict[str, list[dict]] = {"churn": [], "resident": []}
    budgets = {"churn": churn_budgets, "resident": resident_budgets}
    for repeat in range(args.repeats):
        order = ("churn", "resident") if repeat % 2 == 0 else ("resident", "churn")
        for mode in order:
            runs[mode].append(run_mode(mode, args, model_dir, adapters, trace, budgets[mode]))
            f = figures(mode, runs[mode][-1:])
            print(
                f"[{repeat}] {mode}: ITL P50 {f['itl']['p50_ms']} ms, P99 {f['itl']['p99_ms']} "
                f"ms, max {f['itl']['max_ms']} ms; {f['tokens_per_s']} tok/s; device hits "
                f"{f['adapters']['device_hits']}/{f['requests']}, loads {f['adapters']['loads']}; "
                f"cores used {f['cores_used']}, load avg up to {f['loadavg_1m_max']}",
                flush=True,
            )

    churn, resident = figures("churn", runs["churn"]), figures("resident", runs["resident"])
    ratio_p99 = _ratio(churn["itl"]["p99_ms"], resident["itl"]["p99_ms"])
    max_load = max(churn["loadavg_1m_max"], resident["loadavg_1m_max"])
    min_cores = min(churn["cores_used"], resident["cores_used"])
    report = {
        "benchmark": "adapter_churn",
        "device": torch.device(args.device).type,
        "config": {
            "mode": args.mode,
            "model": model_dir.name,
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
            "max_model_len": MAX_MODEL_LEN,
            "seed": args.seed,
            "repeats": args.repeats,
            "threads": args.threads,
            "prompt_tokens": [len(r.prompt) for r in trace],
            "churn_budgets": churn_budgets.summary(),
            "resident_budgets": resident_budgets.summary(),
            **sizes,
        },
        "machine": machine,
        "churn": churn,
        "resident": resident,
        "ratio_itl_p99": ratio_p99,
        "ratio_itl_p50": _ratio(churn["itl"]["p50_ms"], resident["itl"]["p50_ms"]),
        "target_ratio": TARGET_RATIO,
        "verdict_met": ratio_p99 is not None and ratio_p99 <= TARGET_RATIO,
        "per_repeat": [
            _repeat_figures(c, r) for c, r in zip(runs["churn"], runs["resident"], strict=True)
        ],
        "max_loadavg_1m": round(max_load, 2),
        "contended": max_load > machine["nproc"] + 0.5 or min_cores < 0.75 * args.threads,
        "command": " ".join([".venv/bin/python", "benchmarks/adapter_churn.py", *sys.argv[1:]]),
    }
    report["script_seconds"] = round(time.perf_counter() - script_start, 1)
    suffix = ("" if args.mode == "full" else f"_{args.mode}") + (
        f"_threads{args.threads}" if args.threads_given else ""
    )
    out_json = args.out / f"adapter_churn_{report['device']}{suffix}.json"
    write_atomic(out_json, json.dumps(report, indent=2) + "\n")
    markdown = render_markdown(report)
    write_atomic(out_json.with_suffix(".md"), markdown)
    print()
    print(markdown)
    print(f"wrote {out_json} and {out_json.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
