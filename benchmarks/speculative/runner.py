"""``loramux bench speculative``: what n-gram speculation gains where answers copy, and costs
where they do not (the study in ``docs/benchmarks.md``; the requests in ``prompts.py``).

Two engines in this process, alike but for ``speculative_method`` (``off``; ``ngram``, the
preset's), no prefix caching (every run computes its prompts), greedy, EOS on. Per batch
size b and workload: a warm-up of each engine, then ``--repeats`` pairs of runs; a pair's
two runs serve the same requests back to back, in an order that alternates between pairs
(a drift in the machine's speed favours neither). At batch 1 pair r serves request r mod 4;
at b > 1 a pair serves 2b requests, b in flight, each that finishes replaced by the next
(a server whose queue is never empty). A closed batch would wait for its slowest request,
so speeding up the others would show as nothing: in closed batches of 4 copy measured
1.34-1.36x and chat 0.86-0.87x (2026-11-27), against the goals' 1.5x and 0.95x. Every pair
checks that both engines produced the same token ids: a difference fails the goals and
the command exits with 1.

The recorded ``benchmarks/results/bench_speculative.*`` is ``--threads 1``: on the shared
2-core machine torch's two threads wait on cores other processes hold and the times
scatter; one thread gives both engines the same steady machine. ``--smoke`` runs on
SmolLM2 too: the tiny random test model copies nothing, so prompt lookup proposes nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import sys
import time
from pathlib import Path

from loramux.benchmarks.common.files import (
    add_output_options,
    check_sized,
)
from loramux.benchmarks.common.machine import Clock, contention, machine_info
from loramux.benchmarks.common.models import prepare_model
from loramux.benchmarks.serve.presets import PRESETS
from loramux.benchmarks.speculative.prompts import REQUESTS, WORKLOADS, prompts
from loramux.benchmarks.speculative.report import judge, summarize, write_results

PRESET = PRESETS["speculative"]
SIZES = {
    # repeats: at batch 1 each of a workload's four requests once
    "full": {"tokens": 96, "repeats": 4, "batch_sizes": [1, 4]},
    "smoke": {"tokens": 8, "repeats": 1, "batch_sizes": [1]},  # and no warm-up
}
QUEUE_PER_SLOT = 2  # at batch b > 1 a run serves this many times b requests
WARMUP_TOKENS = 8
ENGINES = ("off", "ngram")
# The engine's counters, summed over adapters, read around each run: speculation's, and
# the decode steps and tokens they are set against.
COUNTERS = (
    "loramux_spec_proposed_tokens",
    "loramux_spec_accepted_tokens",
    "loramux_spec_verify_steps",
    "loramux_decode_steps",
    "loramux_adapter_generated_tokens",
)
_RUN_IDS = itertools.count()


def add_options(parser: argparse.ArgumentParser) -> None:
    full = SIZES["full"]
    parser.add_argument("--smoke", action="store_true", help="seconds, for the test")
    parser.add_argument("--model", type=Path, help="HF-format model folder (default SmolLM2)")
    parser.add_argument(
        "--tokens", type=int, help=f"max tokens a request (default {full['tokens']})"
    )
    parser.add_argument(
        "--repeats", type=int, help=f"pairs per batch size and workload (default {full['repeats']})"
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="default 1 4")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's)")
    add_output_options(parser)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_sized(parser, args, SIZES, ("tokens", "repeats", "batch_sizes", "threads"))
    args.workloads = list(dict.fromkeys(args.workloads))


def engine_configs(model_dir: Path) -> dict:
    """The two engines' configs: the preset's, and the same with speculation off."""
    from loramux.engine import EngineConfig

    ngram = EngineConfig(model=str(model_dir), **PRESET.engine)
    return {"off": dataclasses.replace(ngram, speculative_method="off"), "ngram": ngram}


def requests_of(batch: int, pair: int) -> list[int]:
    """The requests pair ``pair`` serves at batch size ``batch``: one at batch 1,
    ``QUEUE_PER_SLOT * batch`` at larger batches."""
    count = len(REQUESTS["copy"])
    n = 1 if batch == 1 else QUEUE_PER_SLOT * batch
    return [(pair * n + i) % count for i in range(n)]


def serve(engine, texts: list[str], params, in_flight: int) -> list:
    """``texts`` through ``engine``, ``in_flight`` at a time (continuous batching); the
    outputs in the order of ``texts``."""
    ids = [f"bench-{next(_RUN_IDS)}" for _ in texts]
    index = {rid: i for i, rid in enumerate(ids)}
    outs: list = [None] * len(texts)
    pending = list(range(len(texts)))
    running = 0
    while pending or engine.has_unfinished_requests():
        while pending and running < in_flight:
            i = pending.pop(0)
            engine.add_request(ids[i], texts[i], params)
            running += 1
        for out in engine.step():
            if out.finished:
                outs[index[out.request_id]] = out
                running -= 1
    return outs


class StepTimer:
    """The start and end (``time.monotonic``, the requests' metrics' clock) of each of the
    engine's steps, by wrapping ``engine.step``."""

    def __init__(self, engine) -> None:
        self.spans: list[tuple[float, float]] = []
        step = engine.step

        def timed_step():
            started = time.monotonic()
            outputs = step()
            self.spans.append((started, time.monotonic()))
            return outputs

        engine.step = timed_step

    def decode_steps(self, after: float) -> list[float]:
        """The seconds of each step that started at or after ``after``."""
        return [end - start for start, end in self.spans if start >= after]


def read_counters(engine) -> dict[str, float]:
    """``COUNTERS`` now, each summed over its labels."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    for metric in engine.metrics.registry.collect():
        if metric.name in totals:
            totals[metric.name] = sum(s.value for s in metric.samples if s.name.endswith("_total"))
    return totals


def timed_run(
    engine, timer: StepTimer, name: str, texts: list[str], indices: list[int], args, batch: int
):
    """One run of ``texts`` (the workload's requests ``indices``) on engine ``name``, ``batch``
    in flight: its figures, and each output's token ids."""
    from loramux.engine import SamplingParams

    params = SamplingParams(max_tokens=args.tokens, temperature=0.0)
    timer.spans.clear()
    before = read_counters(engine)
    with Clock() as clock:
        outs = serve(engine, texts, params, batch)
    after = read_counters(engine)
    errors = [o.error for o in outs if o.error is not None]
    if errors:
        raise RuntimeError(f"{name} engine: {len(errors)} request(s) failed: {errors[0]}")
    requests = [
        {
            "request": i,
            "prompt_tokens": len(o.prompt_token_ids),
            "tokens": len(o.token_ids),
            "finish_reason": o.finish_reason,
            "decode_steps": o.metrics.decode_steps,
            "proposed": o.metrics.spec_proposed_tokens,
            "accepted": o.metrics.spec_accepted_tokens,
            "ids_sha1": hashlib.sha1(str(o.token_ids).encode()).hexdigest()[:12],
        }
        for i, o in zip(indices, outs, strict=True)
    ]
    made, steps, proposed, accepted = (
        sum(r[key] for r in requests) for key in ("tokens", "decode_steps", "proposed", "accepted")
    )
    counters = {k.removeprefix("loramux_"): int(after[k] - before[k]) for k in COUNTERS}
    # Until every request had its first token: the prompts (one step: the step budget holds
    # every batch's prompts), alike on both engines; speculation only shortens what follows,
    # the steps that each emit a token (and the accepted proposals) per running request.
    prefilled = max(o.metrics.first_token_time for o in outs)
    prefill = prefilled - min(o.metrics.arrival_time for o in outs)
    decode_steps = timer.decode_steps(after=prefilled)
    run = {
        "engine": name,
        "seconds": round(clock.seconds, 3),
        "tokens": made,
        "tokens_per_s": round(made / clock.seconds, 3),
        "prefill_seconds": round(prefill, 3),
        "decode_tokens_per_s": round((made - len(outs)) / (clock.seconds - prefill), 3),
        "engine_steps": len(timer.spans),
        "engine_decode_steps": len(decode_steps),
        "ms_per_decode_step": (
            round(1000 * sum(decode_steps) / len(decode_steps), 2) if decode_steps else None
        ),
        **clock.summary(),
        "decode_steps": steps,
        "tokens_per_step": round(made / steps, 3) if steps else None,
        "proposed": proposed,
        "accepted": accepted,
        "acceptance": round(accepted / proposed, 4) if proposed else None,
        "counters": counters,
        # The registry saw what the requests' metrics say (the engine counts both).
        "counters_agree": (
            counters["spec_proposed_tokens"],
            counters["spec_accepted_tokens"],
            counters["decode_steps"],
            counters["adapter_generated_tokens"],
        )
        == (proposed, accepted, steps, made),
        "requests": requests,
    }
    return run, [list(o.token_ids) for o in outs]


def mismatches(indices: list[int], off: list[list[int]], ngram: list[list[int]]) -> list[dict]:
    """Where the two engines' outputs differ: per request, the first differing position."""
    return [
        {
            "request": i,
            "first_difference": next(
                (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            ),
            "off_tokens": len(a),
            "ngram_tokens": len(b),
        }
        for i, a, b in zip(indices, off, ngram, strict=True)
        if a != b
    ]


def measure(engines: dict, timers: dict, workload: str, batch: int, args) -> dict:
    """Warm-up, then ``args.repeats`` pairs of runs of ``workload`` at ``batch``."""
    from loramux.engine import SamplingParams

    all_texts = prompts(engines["off"].tokenizer, workload)
    warmup = SamplingParams(max_tokens=min(args.tokens, WARMUP_TOKENS), temperature=0.0)
    for engine in engines.values() if not args.smoke else ():  # shapes, the verify path
        engine.generate([all_texts[i] for i in requests_of(batch, 0)], warmup)
    pairs = []
    for pair in range(args.repeats):
        indices = requests_of(batch, pair)
        texts = [all_texts[i] for i in indices]
        order = ENGINES if pair % 2 == 0 else ENGINES[::-1]
        runs, ids = {}, {}
        for name in order:
            runs[name], ids[name] = timed_run(
                engines[name], timers[name], name, texts, indices, args, batch
            )
        differ = mismatches(indices, ids["off"], ids["ngram"])
        off, ngram = runs["off"], runs["ngram"]
        speedup = ngram["tokens_per_s"] / off["tokens_per_s"]
        pairs.append(
            {
                "pair": pair,
                "order": list(order),
                "requests": indices,
                "off": off,
                "ngram": ngram,
                "speedup": round(speedup, 4),
                "outputs_match": not differ,
                "mismatches": differ,
            }
        )
        print(
            f"  {workload} batch {batch} pair {pair + 1} (requests {indices}): off "
            f"{off['tokens_per_s']:.2f} tok/s, ngram {ngram['tokens_per_s']:.2f} tok/s "
            f"= {speedup:.3f}x; accepted {ngram['accepted']}/{ngram['proposed']}, "
            f"{ngram['tokens_per_step']} tokens/step; outputs "
            + (f"DIFFER in {len(differ)} request(s)" if differ else "match"),
            flush=True,
        )
    return {"workload": workload, "batch": batch, "pairs": pairs}


def run(args: argparse.Namespace) -> int:
    """Measure, then write ``<out>/bench_speculative[-smoke].{json,md,png}``; 1 when the
    two engines' outputs differed anywhere."""
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    from loramux.engine import Engine

    model_dir = args.model or prepare_model(args.cache_dir)
    machine = machine_info()
    configs = engine_configs(model_dir)
    engines = {name: Engine(config) for name, config in configs.items()}
    timers = {name: StepTimer(engine) for name, engine in engines.items()}
    try:
        print(
            f"{args.command_line}: at most {args.tokens} tokens a request, {args.repeats} pair(s) "
            f"per batch size {args.batch_sizes} and workload {args.workloads}",
            flush=True,
        )
        results = [
            measure(engines, timers, workload, batch, args)
            for batch in args.batch_sizes
            for workload in args.workloads
        ]
    finally:
        for engine in engines.values():
            engine.close()
    pairs = [p for r in results for p in r["pairs"]]
    runs = [p[name] for p in pairs for name in ENGINES]
    prompt_tokens = {
        workload: {
            str(q["request"]): q["prompt_tokens"]
            for r in results
            if r["workload"] == workload
            for p in r["pairs"]
            for q in p["off"]["requests"]
        }
        for workload in args.workloads
    }
    summaries = summarize(results)
    report = {
        "preset": PRESET.name,
        "description": PRESET.description,
        "smoke": bool(args.smoke),
        "command": args.command_line,
        "model": Path(model_dir).name,
        "engine_configs": {
            name: {k: v for k, v in dataclasses.asdict(c).items() if k != "model"}
            for name, c in configs.items()
        },
        "tokens": args.tokens,
        "repeats": args.repeats,
        "warmup": not args.smoke,
        "batch_sizes": args.batch_sizes,
        "workloads": args.workloads,
        "prompt_tokens": {w: dict(sorted(n.items())) for w, n in prompt_tokens.items()},
        "summaries": summaries,
        "outputs_identical": all(p["outputs_match"] for p in pairs),
        "counters_agree": all(run["counters_agree"] for run in runs),
        "goals": judge(PRESET.goals, summaries, args),
        "machine": machine,
        "contention": contention(runs, machine),
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_results(args.out / f"bench_{PRESET.name}{'-smoke' if args.smoke else ''}", report)
    if not report["outputs_identical"]:
        print(
            "FAILED: speculation changed the output token ids of some requests (see "
            "'mismatches' in the report)",
            file=sys.stderr,
        )
        return 1
    return 0
