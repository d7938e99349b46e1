"""``loramux bench speculative``: what n-gram speculation gains where answers copy, and costs
where they do not.

SmolLM2-135M-Instruct (``--model`` for another) in float32 on the CPU, greedy, chat-template
prompts (``speculative_prompts``): a **copy** workload (rewrite a passage with one edit,
repeat it, copy out the sentences about one subject, correct its spelling: answers that copy
long spans of the prompt) and a **chat** workload (open questions, nothing to copy). Every
request stops at EOS or after ``--tokens`` tokens (``ignore_eos`` off: an answer ends where
the model ends it, the same on both engines).

Two engines in this process, alike but for ``speculative_method``: ``off``, and ``ngram``
(prompt lookup, up to 4 proposals a step, suffixes of 4 down to 2 tokens; the adaptive draft
length backs off where proposals are rejected). No prefix caching: every run computes its
prompts on either engine. Per batch size b (``--batch-sizes``, default 1 and 4) and
workload: a warm-up of each engine, then ``--repeats`` pairs of runs. At batch 1 pair r
serves request r (mod 4), so the pairs go through the four requests in turn. At batch b > 1
a pair serves 2b requests (each of the four twice at batch 4) with b in flight at a time:
when one finishes the next starts, as in a server whose queue is never empty (continuous
batching). A closed batch of b requests that all start and must all finish together would
instead wait for its slowest request, so speeding up the others would show as nothing: on
this CPU, in closed batches of 4, copy measured 1.34-1.36x and chat 0.86-0.87x (2026-11-27,
before this change), against the goals' 1.5x and 0.95x.
A pair's two runs (off, ngram) serve the same prompts back to back, in an order that
alternates between pairs (a drift in the machine's speed favours neither).

Per run: wall seconds, output tokens, tokens/s (prefill included, the same on both), cores
used and the load; on ngram runs the tokens proposed and accepted (the requests' metrics,
cross-checked against the engine's ``loramux_spec_*`` counters), the acceptance rate and
the tokens per step (output tokens / decode steps). Every pair checks that both engines
produced the same token ids for every request: a difference is marked in the report,
fails the goals and makes the command exit with 1.

The speedup of a workload at a batch size is the median over its pairs of ngram tokens/s /
off tokens/s (``speculative_report``). Beside it, not judged: the same after the prompts,
from the decode-phase tokens/s (output tokens after each request's first, over the seconds
after the last first token), the prefill's share of an off run (the part of the wall time
speculation cannot shorten), and the milliseconds of an engine step after the prompts on
each engine (``engine.step`` timed): their ratio is what verifying the proposals costs,
against the tokens per step it buys. Goals (``bench_presets``' ``speculative``): copy at
least 1.5x, chat at least 0.95x (at most 5% lost where speculation does not help).

The recorded ``benchmarks/results/bench_speculative.*`` is ``loramux bench speculative
--threads 1``: on the 2-core development machine that other work shares, torch's two
threads wait on cores other processes hold and the runs' times scatter (see
``structured_overhead``); one thread gives both engines the same steady machine.
``--smoke``: 8 tokens, batch 1, one pair, no warm-up: seconds on SmolLM2 (the tiny random
test model copies nothing, so prompt lookup proposes nothing there).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import sys
import time
from pathlib import Path

from loramux.benchmarks.bench_presets import PRESETS
from loramux.benchmarks.common.files import add_output_options, check_output_options, write_report
from loramux.benchmarks.common.machine import Clock, contention, machine_info
from loramux.benchmarks.common.models import prepare_model
from loramux.benchmarks.speculative_prompts import REQUESTS, WORKLOADS, prompts
from loramux.benchmarks.speculative_report import (
    judge,
    render_markdown,
    summarize,
    write_plot,
)

PRESET = PRESETS["speculative"]
DEFAULT_TOKENS = 96
DEFAULT_REPEATS = 4  # at batch 1: each of the four requests of a workload once
BATCH_SIZES = (1, 4)
# At batch b > 1 a run serves this many times b requests, b in flight at a time.
QUEUE_PER_SLOT = 2
_RUN_IDS = itertools.count()
SMOKE = {"tokens": 8, "repeats": 1, "batch_sizes": [1]}  # and no warm-up
WARMUP_TOKENS = 8
ENGINES = ("off", "ngram")
# The engine's counters (``engine.metrics.registry``), summed over adapters, read around
# each run: speculation's, and the decode steps and tokens they are set against.
COUNTERS = (
    "loramux_spec_proposed_tokens",
    "loramux_spec_accepted_tokens",
    "loramux_spec_verify_steps",
    "loramux_decode_steps",
    "loramux_adapter_generated_tokens",
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="loramux bench speculative", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--smoke", action="store_true", help="seconds, for the test")
    parser.add_argument("--model", type=Path, help="HF-format model folder (default SmolLM2)")
    parser.add_argument(
        "--tokens", type=int, help=f"max tokens a request (default {DEFAULT_TOKENS})"
    )
    parser.add_argument(
        "--repeats", type=int, help=f"pairs per batch size and workload (default {DEFAULT_REPEATS})"
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="default 1 4")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's)")
    add_output_options(parser)
    args = parser.parse_args(argv)
    check_output_options(parser, args)
    defaults = (
        SMOKE
        if args.smoke
        else {
            "tokens": DEFAULT_TOKENS,
            "repeats": DEFAULT_REPEATS,
            "batch_sizes": list(BATCH_SIZES),
        }
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if min(args.tokens, args.repeats, *args.batch_sizes) < 1:
        parser.error("--tokens, --repeats and --batch-sizes must be positive")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be positive")
    args.workloads = list(dict.fromkeys(args.workloads))
    args.command = " ".join(["loramux bench speculative", *argv])
    return args


def engine_configs(model_dir: Path) -> dict:
    """The two engines' configs: the preset's, and the same with speculation off."""
    from loramux.engine import EngineConfig

    ngram = EngineConfig(model=str(model_dir), **PRESET.engine)
    return {"off": dataclasses.replace(ngram, speculative_method="off"), "ngram": ngram}


def requests_of(batch: int, pair: int) -> list[int]:
    """The workload's requests pair ``pair`` serves at batch size ``batch``: one at batch 1,
    ``QUEUE_PER_SLOT * batch`` at larger batches (``batch`` of them in flight)."""
    count = len(REQUESTS["copy"])
    n = 1 if batch == 1 else QUEUE_PER_SLOT * batch
    return [(pair * n + i) % count for i in range(n)]


def serve(engine, texts: list[str], params, in_flight: int) -> list:
    """``texts`` through ``engine`` with ``in_flight`` of them running at a time: each that
    finishes lets the next in (continuous batching, as a server with a queue runs)."""
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
    engine,
    timer: StepTimer,
    name: str,
    texts: list[str],
    indices: list[int],
    tokens: int,
    in_flight: int,
) -> tuple:
    """One run of ``texts`` on ``engine`` (whose steps ``timer`` times), ``in_flight`` at a
    time: its figures, and each output's token ids."""
    from loramux.engine import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    timer.spans.clear()
    before = read_counters(engine)
    with Clock() as clock:
        outs = serve(engine, texts, params, in_flight)
    after = read_counters(engine)
    counters = {k.removeprefix("loramux_"): int(after[k] - before[k]) for k in COUNTERS}
    errors = [o.error for o in outs if o.error is not None]
    if errors:
        raise RuntimeError(f"{name} engine: {len(errors)} request(s) failed: {errors[0]}")
    per_request = [
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
    made = sum(r["tokens"] for r in per_request)
    # Until every request had its first token: the prompts' computation (one step here: the
    # step budget holds every batch's prompts), the same on both engines; speculation only
    # shortens what follows.
    prefilled = max(o.metrics.first_token_time for o in outs)
    prefill = prefilled - min(o.metrics.arrival_time for o in outs)
    # The steps after it: each emits a token (and with speculation the accepted proposals)
    # for every request still running.
    decode_steps = timer.decode_steps(after=prefilled)
    steps = sum(r["decode_steps"] for r in per_request)
    proposed = sum(r["proposed"] for r in per_request)
    accepted = sum(r["accepted"] for r in per_request)
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
        "requests": per_request,
    }
    return run, [list(o.token_ids) for o in outs]


def compare(indices: list[int], off: list[list[int]], ngram: list[list[int]]) -> list[dict]:
    """Where the two engines' outputs differ: per request, the first differing position."""
    mismatches = []
    for i, a, b in zip(indices, off, ngram, strict=True):
        if a != b:
            first = next(
                (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            )
            mismatches.append(
                {
                    "request": i,
                    "first_difference": first,
                    "off_tokens": len(a),
                    "ngram_tokens": len(b),
                }
            )
    return mismatches


def measure(
    engines: dict, timers: dict, workload: str, batch: int, args: argparse.Namespace
) -> dict:
    """Warm-up, then ``args.repeats`` pairs of runs of ``workload`` at ``batch``."""
    tokenizer = engines["off"].tokenizer
    all_texts = prompts(tokenizer, workload, len(REQUESTS[workload]))
    first = requests_of(batch, 0)
    for engine in engines.values() if not args.smoke else ():  # warm-up: shapes, verify path
        engine.generate([all_texts[i] for i in first], _warmup_params(args.tokens))
    pairs = []
    for pair in range(args.repeats):
        indices = requests_of(batch, pair)
        texts = [all_texts[i] for i in indices]
        order = ENGINES if pair % 2 == 0 else ENGINES[::-1]
        runs, ids = {}, {}
        for name in order:
            runs[name], ids[name] = timed_run(
                engines[name], timers[name], name, texts, indices, args.tokens, batch
            )
        mismatches = compare(indices, ids["off"], ids["ngram"])
        speedup = runs["ngram"]["tokens_per_s"] / runs["off"]["tokens_per_s"]
        pairs.append(
            {
                "pair": pair,
                "order": list(order),
                "requests": indices,
                "off": runs["off"],
                "ngram": runs["ngram"],
                "speedup": round(speedup, 4),
                "outputs_match": not mismatches,
                "mismatches": mismatches,
            }
        )
        ngram = runs["ngram"]
        print(
            f"  {workload} batch {batch} pair {pair + 1} (requests {indices}): off "
            f"{runs['off']['tokens_per_s']:.2f} tok/s, ngram {ngram['tokens_per_s']:.2f} tok/s "
            f"= {speedup:.3f}x; accepted {ngram['accepted']}/{ngram['proposed']}, "
            f"{ngram['tokens_per_step']} tokens/step; outputs "
            + ("match" if not mismatches else f"DIFFER in {len(mismatches)} request(s)"),
            flush=True,
        )
    return {"workload": workload, "batch": batch, "pairs": pairs}


def _warmup_params(tokens: int):
    from loramux.engine import SamplingParams

    return SamplingParams(max_tokens=min(tokens, WARMUP_TOKENS), temperature=0.0)


def run_preset(args: argparse.Namespace) -> dict:
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
            f"{args.command}: at most {args.tokens} tokens a request, {args.repeats} pair(s) "
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
    runs = [p[name] for r in results for p in r["pairs"] for name in ENGINES]
    prompt_tokens = {w: {} for w in args.workloads}  # workload -> request -> prompt tokens
    for result in results:
        for q in (q for p in result["pairs"] for q in p["off"]["requests"]):
            prompt_tokens[result["workload"]][str(q["request"])] = q["prompt_tokens"]
    prompt_tokens = {w: dict(sorted(n.items())) for w, n in prompt_tokens.items()}
    summaries = summarize(results)
    return {
        "preset": PRESET.name,
        "description": PRESET.description,
        "smoke": bool(args.smoke),
        "command": args.command,
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
        "prompt_tokens": prompt_tokens,
        "summaries": summaries,
        "outputs_identical": all(p["outputs_match"] for r in results for p in r["pairs"]),
        "counters_agree": all(run["counters_agree"] for run in runs),
        "goals": judge(PRESET.goals, summaries, args),
        "machine": machine,
        "contention": contention(runs, machine),
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    """Run, then write ``<out>/bench_speculative[-smoke].{json,md,png}`` and print the
    markdown; 1 when the two engines' outputs differed anywhere."""
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    report = run_preset(args)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"bench_{PRESET.name}{'-smoke' if report['smoke'] else ''}"
    write_report(stem, report, render_markdown(report, write_plot(report, stem)))
    if not report["outputs_identical"]:
        print(
            "FAILED: speculation changed the output token ids of some requests (see "
            "'mismatches' in the report)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
