"""``python -m loramux.benchmarks.structured_overhead``: what a grammar costs per token.

The same requests decoded constrained (a strict ``json_schema``) and unconstrained, on
SmolLM2-135M-Instruct in float32 on the CPU, at batch sizes 1 and 8. So that both produce
the same tokens' worth of steps, every request makes exactly ``--tokens`` tokens: the
unconstrained ones with ``ignore_eos``; the constrained ones against a schema that cannot be
complete that soon (a list of at least 50 records), so ``max_tokens`` ends each of them too.
Greedy, chat prompts that ask for such records, no prefix caching (every run computes its
prompts alike).

Per batch size: a warm-up of each kind, then ``--repeats`` pairs of runs whose order
alternates (a drift in the machine's speed favours neither side). Per run: wall seconds,
ms per output token (wall over batch x tokens, prefill included, the same in both), and
for the constrained runs the mask fill (the runner's one call per step for every
constrained row) and its application to the logits, per step. The overhead is the median
over pairs of constrained / unconstrained seconds. Also: building the compiler (once per
engine) and compiling the schema cold.

The recorded ``benchmarks/results/structured_overhead.json`` is this run with ``--threads 1
--repeats 5`` on the 2-core development machine, which other work shares (``contention``):
with torch's two threads every parallel op waits for a core another process holds (one
run's batch-1 steps took 266 ms a token against 74 ms with one thread, its mask apply 32 ms
a step against 0.3 ms). One thread gives both sides the same steady machine.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import statistics
import time
from pathlib import Path

from loramux.benchmarks.common.files import add_output_options
from loramux.benchmarks.common.machine import Clock, contention, machine_info
from loramux.benchmarks.common.models import prepare_model
from loramux.benchmarks.common.report import Markdown, pct, write

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "category": {"type": "string", "enum": ["tool", "food", "toy", "book"]},
        "price": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "category", "price", "tags"],
    "additionalProperties": False,
}
# At least 50 records: far more than the tokens a run makes, so max_tokens ends it.
SCHEMA = {"type": "array", "items": RECORD, "minItems": 50}
SUBJECTS = ("a hardware shop", "a bakery", "a toy store", "a library", "a kitchen", "a garden")


def _prompts(engine, count: int) -> list[str]:
    questions = (
        f"List products of {SUBJECTS[i % len(SUBJECTS)]} as a JSON array of records with "
        f"name, category, price and tags (list {i + 1})."
        for i in range(count)
    )
    chat = engine.tokenizer.apply_chat_template
    return [
        chat([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]


class _MaskTimer:
    """Times the runner's mask fill and the sampler's apply, per step, by wrapping them."""

    def __init__(self, engine) -> None:
        from loramux.engine.structured import StepMasks

        self.fill_ms: list[float] = []
        self.apply_ms: list[float] = []
        runner, fill, apply = engine.executor, engine.executor._grammar_masks, StepMasks.apply

        def timed_fill(sampling):
            started = time.perf_counter()
            masks = fill(sampling)
            self.fill_ms.append((time.perf_counter() - started) * 1000)
            return masks

        def timed_apply(masks, logits):
            started = time.perf_counter()
            apply(masks, logits)
            self.apply_ms.append((time.perf_counter() - started) * 1000)

        runner._grammar_masks, StepMasks.apply = timed_fill, timed_apply

    def clear(self) -> None:
        self.fill_ms.clear()
        self.apply_ms.clear()


def _run(engine, prompts: list[str], tokens: int, constrained: bool, timer: _MaskTimer) -> dict:
    from loramux.engine import JsonSchema, SamplingParams

    if constrained:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, structured=JsonSchema(SCHEMA))
    else:
        params = SamplingParams(
            max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=0.0
        )
    timer.clear()
    with Clock() as clock:
        outs = engine.generate(prompts, params)
    made = [len(o.token_ids) for o in outs]
    if made != [tokens] * len(prompts):
        raise RuntimeError(f"every request must make {tokens} tokens; made {made}")
    run = {
        "seconds": round(clock.seconds, 3),
        "ms_per_output_token": round(clock.seconds * 1000 / sum(made), 3),
        "finish_reasons": sorted({o.finish_reason for o in outs}),
        **clock.summary(),
    }
    if constrained:
        run["mask_fill_ms_per_step"] = _summary(timer.fill_ms)
        run["mask_apply_ms_per_step"] = _summary(timer.apply_ms)
        run["sample_output"] = outs[0].text[:120]
    return run


def _summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {
        "steps": len(values),
        "median": round(statistics.median(ordered), 4),
        "p90": round(ordered[int(0.9 * (len(ordered) - 1))], 4),
        "mean": round(statistics.fmean(ordered), 4),
    }


def measure_batch(engine, batch: int, tokens: int, repeats: int, timer: _MaskTimer) -> dict:
    prompts = _prompts(engine, batch)
    for constrained in (False, True):  # warm-up: kernels, the compiled schema, lexer
        _run(engine, prompts, min(tokens, 8), constrained, timer)
    pairs, ratios = [], []
    for repeat in range(repeats):
        order = (False, True) if repeat % 2 == 0 else (True, False)
        runs = {c: _run(engine, prompts, tokens, c, timer) for c in order}
        pairs.append({"unconstrained": runs[False], "constrained": runs[True]})
        ratios.append(runs[True]["seconds"] / runs[False]["seconds"])
        print(f"  batch {batch}, pair {repeat + 1}: ratio {ratios[-1]:.3f}", flush=True)

    def median_of(kind: str, key: str) -> float:
        return round(statistics.median(p[kind][key] for p in pairs), 3)

    fills = [p["constrained"]["mask_fill_ms_per_step"]["median"] for p in pairs]
    applies = [p["constrained"]["mask_apply_ms_per_step"]["median"] for p in pairs]
    plain_step_ms = median_of("unconstrained", "ms_per_output_token") * batch
    mask_ms = statistics.median(fills) + statistics.median(applies)
    return {
        "batch": batch,
        "tokens_per_request": tokens,
        "unconstrained_ms_per_output_token": median_of("unconstrained", "ms_per_output_token"),
        "constrained_ms_per_output_token": median_of("constrained", "ms_per_output_token"),
        "overhead_ratio_median": round(statistics.median(ratios), 3),
        "overhead_ratios": [round(r, 3) for r in ratios],
        "mask_fill_ms_per_step_median": round(statistics.median(fills), 4),
        "mask_apply_ms_per_step_median": round(statistics.median(applies), 4),
        # The masks' own cost against an unconstrained step: the overhead without the noise
        # of whole runs (a shared machine drifts by several percent between runs).
        "mask_share_of_step": round(mask_ms / plain_step_ms, 4),
        "pairs": pairs,
    }


def measure_compile(engine) -> dict:
    from loramux.engine import JsonSchema

    started = time.perf_counter()
    compiler = engine.grammars.compiler  # built here: the tokenizer's view for llguidance
    built = time.perf_counter() - started
    started = time.perf_counter()
    compiler.compile(JsonSchema(SCHEMA))
    cold = time.perf_counter() - started
    return {"compiler_build_ms": round(built * 1000, 1), "schema_compile_ms": round(cold * 1000, 2)}


def render(report: dict) -> Markdown:
    md = Markdown(
        f"Structured-output overhead on {report['model']} (CPU, float32, greedy, "
        f"{report['tokens']} tokens a request)"
    )
    compiled = report["compile"]
    md.text(
        f"Compiler build {compiled['compiler_build_ms']} ms, schema compile "
        f"{compiled['schema_compile_ms']} ms (cold)."
    )
    columns = ("batch", "unconstrained ms/token", "constrained ms/token", "ratio (median)")
    rows = [
        (
            b["batch"],
            b["unconstrained_ms_per_output_token"],
            b["constrained_ms_per_output_token"],
            f"{b['overhead_ratio_median']} {b['overhead_ratios']}",
            b["mask_fill_ms_per_step_median"],
            b["mask_apply_ms_per_step_median"],
            pct(b["mask_share_of_step"], 2),
        )
        for b in report["batches"]
    ]
    md.table((*columns, "mask fill ms/step", "mask apply ms/step", "masks / step"), rows)
    md.machine(report["machine"], note=f"llguidance {report['llguidance']}.")
    busy = report["contention"]
    return md.text(
        f"Contention: 1-minute load average up to {busy['max_loadavg_1m']}, cores used as low "
        f"as {busy['min_cores_used']} (contended: {busy['contended']})."
    )


def add_options(parser: argparse.ArgumentParser) -> None:
    add_output_options(parser)
    parser.add_argument("--model", type=Path, help="an HF model folder (default: SmolLM2)")
    parser.add_argument("--tokens", type=int, default=64, help="per request")
    parser.add_argument("--repeats", type=int, default=3, help="pairs per batch")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's)")


def run(args: argparse.Namespace) -> int:
    from loramux.engine import Engine, EngineConfig

    folder = args.model or prepare_model(args.cache_dir)
    engine = Engine(
        EngineConfig(
            model=str(folder),
            device="cpu",
            dtype="float32",
            kv_cache_bytes=256 << 20,
            enable_prefix_caching=False,
            compute_threads=args.threads,
        )
    )
    report = {
        "model": Path(folder).name,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "schema": SCHEMA,
        "machine": machine_info(),
        "llguidance": importlib.metadata.version("llguidance"),
        "compile": measure_compile(engine),
    }
    timer = _MaskTimer(engine)
    report["batches"] = []
    for batch in args.batch_sizes:
        print(f"batch {batch}", flush=True)
        report["batches"].append(measure_batch(engine, batch, args.tokens, args.repeats, timer))
    runs = [run for b in report["batches"] for pair in b["pairs"] for run in pair.values()]
    report["contention"] = contention(runs, report["machine"])
    write(args.out / "structured_overhead", report, render(report))
    return 0
