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
schemas, also after ``malloc_trim(0)`` (what glibc gives back to the system when asked:
the rest of the growth is memory malloc keeps for reuse, not memory anything holds), the
bytes malloc has handed out (``mallinfo2``), the cache's figures, each schema's measured
bytes and compile time. ``benchmarks/results/grammar_cache_memory.{md,json}`` is this run
with the defaults on the 2-core development machine.
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

from loramux.benchmarks.common.files import add_output_options, check_output_options, write_atomic
from loramux.benchmarks.common.machine import machine_info
from loramux.benchmarks.common.models import prepare_model

DEFAULT_SCHEMAS = 100
DEFAULT_VALUES = 12_000
DEFAULT_MAX_TOKENS = 2
UNBOUNDED_BYTES = 64 << 30
# scenario -> (tenants, grammar_cache_bytes, grammar_cache_tenant_bytes); None: the default.
SCENARIOS = {
    "unbounded": (1, UNBOUNDED_BYTES, UNBOUNDED_BYTES),
    "one-tenant": (1, None, None),
    "four-tenants": (4, None, None),
}
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


def _trim() -> bool:
    """glibc's ``malloc_trim(0)``: free pages back to the system (False without glibc)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except AttributeError:
        return False
    trim(0)
    return True


def run_scenario(name: str, model: Path, schemas: int, values: int, max_tokens: int) -> dict:
    """One scenario in this process; its figures."""
    from loramux.engine import Engine, EngineConfig, JsonSchema, SamplingParams
    from loramux.engine.structured.grammar_bytes import HeapMeter

    tenants, budget, tenant_budget = SCENARIOS[name]
    budgets = {} if budget is None else {"grammar_cache_bytes": budget}
    if tenant_budget is not None:
        budgets["grammar_cache_tenant_bytes"] = tenant_budget
    engine = Engine(
        EngineConfig(
            model=str(model),
            device="cpu",
            dtype="float32",
            kv_cache_bytes=64 * MIB,
            enable_prefix_caching=False,
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
            curve.append({"schemas": i + 1, "rss_mib": round(rss_bytes() / MIB, 1)})
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
        "rss_before_mib": round(rss_before / MIB, 1),
        "rss_after_mib": round(rss_after / MIB, 1),
        "rss_growth_mib": round((rss_after - rss_before) / MIB, 1),
        "rss_after_trim_mib": round(rss_trimmed / MIB, 1) if trimmed else None,
        "malloc_growth_mib": (
            None if malloc_before is None else round((malloc_after - malloc_before) / MIB, 1)
        ),
        "rss_curve": curve,
        "cache": {
            "bytes": cache.bytes,
            "entries": cache.entries,
            "tenants": cache.tenants,
            "largest_tenant_bytes": cache.largest_tenant_bytes,
            "evictions": cache.evictions,
            "tenant_evictions": cache.tenant_evictions,
            "evicted_bytes": cache.evicted_bytes,
            "not_kept": cache.not_kept,
        },
        "schema_bytes": {
            "median": int(statistics.median(sizes)),
            "min": min(sizes),
            "max": max(sizes),
        },
        "compile_ms_median": round(statistics.median(seconds) * 1000, 1),
        "mallinfo2_ms": round(mallinfo_ms, 2),
        "wall_s": round(wall, 1),
    }


def _child(args: argparse.Namespace, scenario: str) -> dict:
    command = [
        sys.executable,
        "-m",
        "loramux.benchmarks.grammar_cache_memory",
        "--child",
        scenario,
        "--model",
        str(args.model),
        "--schemas",
        str(args.schemas),
        "--values",
        str(args.values),
        "--max-tokens",
        str(args.max_tokens),
        "--threads",
        str(args.threads),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"scenario {scenario} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def render(report: dict) -> str:
    lines = [
        "# Compiled-grammar cache: memory after distinct large-enum schemas",
        "",
        f"{report['schemas']} distinct schemas of {report['values_per_schema']:,} enum values "
        f"each ({report['scenarios'][0]['schema_chars']:,} characters of JSON), each compiled "
        "through `Engine.compile_structured` and served by `add_request` "
        f"({report['max_tokens']} greedy tokens) on {report['model']} (float32, CPU, "
        f"{report['threads']} torch thread(s)); one process per scenario. RSS in MiB.",
        "",
        "| scenario | budget (per tenant) | tenants | RSS before | RSS after | growth | "
        "after malloc_trim | malloc in use, growth | cache bytes | entries | evictions | "
        "bytes a schema (median) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in report["scenarios"]:
        cache = s["cache"]
        budget = (
            "none (64 GiB)"
            if s["scenario"] == "unbounded"
            else f"{s['budget_bytes'] / MIB:.0f} MiB ({s['tenant_budget_bytes'] / MIB:.0f} MiB)"
        )
        trim = "–" if s["rss_after_trim_mib"] is None else f"{s['rss_after_trim_mib']:,.0f}"
        malloc = "–" if s["malloc_growth_mib"] is None else f"{s['malloc_growth_mib']:,.0f}"
        lines.append(
            f"| {s['scenario']} | {budget} | {s['tenants']} | {s['rss_before_mib']:,.0f} | "
            f"{s['rss_after_mib']:,.0f} | {s['rss_growth_mib']:+,.0f} | {trim} | {malloc} | "
            f"{cache['bytes'] / MIB:,.1f} MiB | {cache['entries']} | {cache['evictions']} | "
            f"{s['schema_bytes']['median'] / MIB:.2f} MiB |"
        )
    lines += [
        "",
        "Compile (median, a miss, measurement included): "
        + ", ".join(f"{s['scenario']} {s['compile_ms_median']} ms" for s in report["scenarios"])
        + "; one `mallinfo2` read (two per compile): "
        + ", ".join(f"{s['mallinfo2_ms']} ms" for s in report["scenarios"])
        + ".",
        "",
        "RSS every 10 schemas:",
        "",
        "| schemas | " + " | ".join(s["scenario"] for s in report["scenarios"]) + " |",
        "|---:|" + "---:|" * len(report["scenarios"]),
    ]
    for row, point in enumerate(report["scenarios"][0]["rss_curve"]):
        cells = [f"{s['rss_curve'][row]['rss_mib']:,.0f}" for s in report["scenarios"]]
        lines.append(f"| {point['schemas']} | " + " | ".join(cells) + " |")
    machine = report["machine"]
    lines += [
        "",
        f"Machine: {machine['cpu_model']}, {machine['nproc']} cores, "
        f"{machine['mem_total_gib']} GiB; Python {machine['python']}, torch {machine['torch']}, "
        f"llguidance {report['llguidance']}; {machine['date']}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_output_options(parser)
    parser.add_argument("--model", type=Path, help="an HF model folder (default: SmolLM2)")
    parser.add_argument("--schemas", type=int, default=DEFAULT_SCHEMAS)
    parser.add_argument("--values", type=int, default=DEFAULT_VALUES, help="enum values each")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="a request")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--child", choices=list(SCENARIOS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.child is not None:
        result = run_scenario(args.child, args.model, args.schemas, args.values, args.max_tokens)
        print(json.dumps(result))
        return 0
    check_output_options(parser, args)
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
        report["scenarios"].append(_child(args, scenario))
    write_atomic(args.out / "grammar_cache_memory.json", json.dumps(report, indent=2) + "\n")
    text = render(report)
    write_atomic(args.out / "grammar_cache_memory.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
