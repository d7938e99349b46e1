"""``python -m loramux.benchmarks.grammar_cache_memory``: what compiled grammars hold in RAM.

Issue 33: every distinct 12,000-value enum schema kept about 6.5 MB in the engine's
compiled-grammar cache, capped only at 512 entries, and the memory never came back. This
sends ``--schemas`` (100) distinct such schemas through the engine's grammar path on
SmolLM2-135M-Instruct (float32, CPU): ``Engine.compile_structured`` as ``AsyncEngine`` calls
it off the engine thread, then ``add_request`` with the schema as a strict ``json_schema``
and greedy steps to its end (``--max-tokens`` each), as a served request goes. Per scenario,
in a process of its own (RSS is a process's):

* ``unbounded``: budgets of 64 GiB, what 512 entries amounted to for such schemas (the
  cache before issue 33);
* ``one-tenant``: the default budgets (256 MiB, 64 MiB a tenant), every schema one tenant's;
* ``four-tenants``: the default budgets, the schemas four tenants' in turn.

Recorded per scenario: the RSS after a warm-up request (the compiler built) and after the
schemas, also after ``malloc_trim(0)`` (what glibc gives back when asked: the rest of the
growth is memory malloc keeps for reuse, not memory anything holds), the bytes malloc has
handed out (``mallinfo2``), the cache's figures, each schema's bytes and compile time.
``benchmarks/results/grammar_cache_memory.{md,json}``: the defaults on the 2-core machine.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from loramux.benchmarks.common.files import add_output_options
from loramux.benchmarks.common.machine import machine_info
from loramux.benchmarks.common.models import prepare_model
from loramux.benchmarks.common.report import Markdown, num, write

UNBOUNDED_BYTES = 64 << 30
UNBOUNDED = {"grammar_cache_bytes": UNBOUNDED_BYTES, "grammar_cache_tenant_bytes": UNBOUNDED_BYTES}
# scenario -> (tenants, the engine's grammar cache budgets; none given: its defaults)
SCENARIOS = {"unbounded": (1, UNBOUNDED), "one-tenant": (1, {}), "four-tenants": (4, {})}
CACHE_FIGURES = ("bytes", "entries", "tenants", "largest_tenant_bytes", "evictions")
CACHE_FIGURES += ("tenant_evictions", "evicted_bytes", "not_kept")
PROMPT = "Pick one of the allowed values and answer in JSON:"
MIB = 1 << 20


def enum_schema(index: int, values: int) -> dict:
    """The ``index``-th distinct schema: an object whose one property is one of ``values``
    strings."""
    return {
        "type": "object",
        "properties": {"value": {"enum": [f"item-{index}-{k}" for k in range(values)]}},
        "required": ["value"],
        "additionalProperties": False,
    }


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _mib(nbytes: int) -> float:
    return round(nbytes / MIB, 1)


def _trim() -> bool:
    """glibc's ``malloc_trim(0)``: free pages back to the system (False without glibc)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except AttributeError:
        return False
    trim(0)
    return True


def run_scenario(
    name: str, model: str, schemas: int, values: int, max_tokens: int, threads: int
) -> dict:
    """One scenario in this process; its figures."""
    from loramux.engine import Engine, EngineConfig, JsonSchema, SamplingParams
    from loramux.engine.structured.grammar_bytes import HeapMeter

    tenants, budgets = SCENARIOS[name]
    engine = Engine(
        EngineConfig(
            model=model,
            device="cpu",
            dtype="float32",
            kv_cache_bytes=64 * MIB,
            enable_prefix_caching=False,
            compute_threads=threads,
            **budgets,
        )
    )
    meter = HeapMeter()

    def serve(request_id: str, spec: JsonSchema, tenant: str) -> tuple[int, float]:
        started = time.perf_counter()
        compiled = engine.compile_structured(spec, tenant)  # as AsyncEngine does, first
        seconds = time.perf_counter() - started
        nbytes = compiled.nbytes
        del compiled
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=spec)
        engine.add_request(request_id, PROMPT, params, tenant=tenant)
        while engine.has_unfinished_requests():
            engine.step()
        return nbytes, seconds

    serve("warm-up", JsonSchema(enum_schema(-1, 10)), "warm-up")  # builds the compiler
    gc.collect()
    rss_before, malloc_before = rss_bytes(), meter.in_use()
    sizes, seconds, curve = [], [], []
    started = time.perf_counter()
    for i in range(schemas):
        nbytes, compile_s = serve(f"r{i}", JsonSchema(enum_schema(i, values)), f"t{i % tenants}")
        sizes.append(nbytes)
        seconds.append(compile_s)
        if (i + 1) % 10 == 0:
            curve.append({"schemas": i + 1, "rss_mib": _mib(rss_bytes())})
    wall = time.perf_counter() - started
    gc.collect()
    rss_after, malloc_after = rss_bytes(), meter.in_use()
    trimmed = _trim()
    rss_trimmed = rss_bytes()
    cache = engine.grammars.cache_stats()
    probe = time.perf_counter()
    for _ in range(20):
        meter.in_use()
    mallinfo_ms = (time.perf_counter() - probe) / 20 * 1000
    return {
        "scenario": name,
        "tenants": tenants,
        "schemas": schemas,
        "values_per_schema": values,
        "schema_chars": len(json.dumps(enum_schema(0, values))),
        "budget_bytes": cache.budget_bytes,
        "tenant_budget_bytes": cache.tenant_budget_bytes,
        "rss_before_mib": _mib(rss_before),
        "rss_after_mib": _mib(rss_after),
        "rss_growth_mib": _mib(rss_after - rss_before),
        "rss_after_trim_mib": _mib(rss_trimmed) if trimmed else None,
        "malloc_growth_mib": None if malloc_before is None else _mib(malloc_after - malloc_before),
        "rss_curve": curve,
        "cache": {name: getattr(cache, name) for name in CACHE_FIGURES},
        "schema_bytes": {
            "median": int(statistics.median(sizes)),
            "min": min(sizes),
            "max": max(sizes),
        },
        "compile_ms_median": round(statistics.median(seconds) * 1000, 1),
        "mallinfo2_ms": round(mallinfo_ms, 2),
        "wall_s": round(wall, 1),
    }


def _in_child(args: argparse.Namespace, scenario: str) -> dict:
    """``run_scenario`` in a process of its own, whose RSS is the scenario's alone."""
    options = (str(args.model), args.schemas, args.values, args.max_tokens, args.threads)
    call = f"run_scenario({scenario!r}, {', '.join(map(repr, options))})"
    code = f"import json; from {__name__} import run_scenario; print(json.dumps({call}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"scenario {scenario} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def render(report: dict) -> Markdown:
    scenarios = report["scenarios"]
    md = Markdown("Compiled-grammar cache: memory after distinct large-enum schemas")
    md.text(
        f"{report['schemas']} distinct schemas of {report['values_per_schema']:,} enum values "
        f"each ({scenarios[0]['schema_chars']:,} characters of JSON), each compiled "
        "through `Engine.compile_structured` and served by `add_request` "
        f"({report['max_tokens']} greedy tokens) on {report['model']} (float32, CPU, "
        f"{report['threads']} torch thread(s)); one process per scenario. RSS in MiB."
    )
    rows = []
    for s in scenarios:
        budget = f"{s['budget_bytes'] / MIB:.0f} MiB ({s['tenant_budget_bytes'] / MIB:.0f} MiB)"
        rows.append(
            (
                s["scenario"],
                "none (64 GiB)" if s["scenario"] == "unbounded" else budget,
                s["tenants"],
                num(s["rss_before_mib"], 0),
                num(s["rss_after_mib"], 0),
                f"{s['rss_growth_mib']:+,.0f}",
                num(s["rss_after_trim_mib"], 0),
                num(s["malloc_growth_mib"], 0),
                num(s["cache"]["bytes"] / MIB, 1, suffix=" MiB"),
                s["cache"]["entries"],
                s["cache"]["evictions"],
                num(s["schema_bytes"]["median"] / MIB, 2, suffix=" MiB"),
            )
        )
    columns = ("scenario", "budget (per tenant)", "tenants", "RSS before", "RSS after", "growth")
    columns += ("after malloc_trim", "malloc in use, growth", "cache bytes", "entries")
    md.table((*columns, "evictions", "bytes a schema (median)"), rows, "ll")
    compiles = ", ".join(f"{s['scenario']} {s['compile_ms_median']} ms" for s in scenarios)
    reads = ", ".join(f"{s['mallinfo2_ms']} ms" for s in scenarios)
    md.text(
        f"Compile (median, a miss, measurement included): {compiles}; one `mallinfo2` read "
        f"(two per compile): {reads}.",
        "RSS every 10 schemas:",
    )
    curve = [
        (point["schemas"], *(num(s["rss_curve"][row]["rss_mib"], 0) for s in scenarios))
        for row, point in enumerate(scenarios[0]["rss_curve"])
    ]
    md.table(("schemas", *(s["scenario"] for s in scenarios)), curve, "r")
    return md.machine(report["machine"], note=f"llguidance {report['llguidance']}.")


def add_options(parser: argparse.ArgumentParser) -> None:
    add_output_options(parser)
    parser.add_argument("--model", type=Path, help="an HF model folder (default: SmolLM2)")
    parser.add_argument("--schemas", type=int, default=100)
    parser.add_argument("--values", type=int, default=12_000, help="enum values each")
    parser.add_argument("--max-tokens", type=int, default=2, help="a request")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)  # the machine's record says what the scenarios had
    args.model = args.model or prepare_model(args.cache_dir)
    report = {
        "model": Path(args.model).name,
        "schemas": args.schemas,
        "values_per_schema": args.values,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "machine": machine_info(),
        "llguidance": importlib.metadata.version("llguidance"),
        "scenarios": [],
    }
    for scenario in args.scenarios:
        print(f"scenario {scenario}", flush=True)
        report["scenarios"].append(_in_child(args, scenario))
    write(args.out / "grammar_cache_memory", report, render(report))
    return 0
