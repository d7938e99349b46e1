"""``loramux bench quant-quality``: what each way of holding the base weights costs in quality,
measured through the engine as it serves.

The text is ``benchmarks/data/quality_text.txt`` (about 3,000 SmolLM2 tokens of plain
English prose written for loramux and dedicated to the public domain, CC0: a narrative, an
explanation, a memoir and a note, so the model meets varied vocabulary). Per mode, for the
base model and for two adapters (rank 8 on q/k/v/o, rank 16 on all seven projections):

* **perplexity** over the text, cut into windows of ``--window`` tokens, each scored by the
  engine itself (``prompt_logprobs``, ``max_tokens=0``): ``exp`` of the mean negative log
  likelihood of every token after a window's first;
* **greedy agreement** with float32 over 64 prompts (the opening words of 64 of the text's
  sentences, ``--tokens`` greedy tokens each): the share of prompts whose tokens are all
  the same, and the mean share of tokens before the first difference.

Modes (``MODES``): ``float32`` (the reference: SmolLM2's GGUF de-quantized once), ``gguf``
(the embedded default: the same file served from its own Q4_1/Q8_0 tensors; the same
values as float32, so any difference is float rounding), ``int8`` and ``int4`` quantized
from the float32 checkpoint as it loads (round to nearest). A caveat the numbers need: the
float32 weights are themselves the de-quantized Q4_1 values, 16 levels per group of 32, so
int4 with groups of 32 recovers them almost exactly (each group's min and max are on the
grid); groups of 64 (SmolLM2's 576 inputs take no larger power of two) re-quantize that
grid, which is not what 4 bits cost a float model, so they are not judged. ``kv-int8`` and
``kv-fp8`` hold the KV cache in 8 bits with a scale per token and KV head
(``kernels/kv_quant.py``) under the float32 weights; ``gguf+kv-int8`` under the GGUF's
(what ``LORAMUX_ENGINE_KV_CACHE_DTYPE=int8`` serves by default). The scoring prefills each
window through the cache, so every token after the first attends to quantized keys and
values, as in serving.

Limits (each ``Mode``'s ``limit``): int8 weights at most 1% perplexity increase over float32,
int4 (groups of 32, the default) at most 5%, int8 or fp8 KV at most 1%. The tests assert
them on the tiny model (``tests/benchmarks/test_quant_quality.py``); the recorded
``benchmarks/results/quant_quality.{md,json}`` is SmolLM2's.
"""

from __future__ import annotations

import argparse
import math
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loramux.benchmarks.common.files import PACKAGE_DIR, add_output_options
from loramux.benchmarks.common.report import Markdown, write

QUALITY_TEXT = PACKAGE_DIR / "data" / "quality_text.txt"
PROMPT_WORDS = 8  # words of a sentence that make a greedy prompt
PROMPTS = 64


@dataclass(frozen=True)
class Mode:
    name: str
    engine: dict = field(default_factory=dict)  # EngineConfig fields over the float32 one
    gguf: bool = False  # served from the GGUF file instead of the float32 checkpoint
    limit: float | None = None  # most relative perplexity increase over float32


MODES = (
    Mode("float32"),
    Mode("gguf", gguf=True),
    Mode("int8", {"quantization": "int8"}, limit=0.01),
    Mode("int4-g32", {"quantization": "int4", "quantization_group_size": 32}, limit=0.05),
    Mode("int4-g64", {"quantization": "int4", "quantization_group_size": 64}),
    Mode("kv-int8", {"kv_cache_dtype": "int8"}, limit=0.01),
    Mode("kv-fp8", {"kv_cache_dtype": "fp8"}, limit=0.01),
    Mode("gguf+kv-int8", {"kv_cache_dtype": "int8"}, gguf=True, limit=0.01),
)


def text_windows(tokenizer, window: int, text: str | None = None) -> list[list[int]]:
    """The text's token ids in consecutive windows of ``window`` (the last may be shorter,
    but at least 2 tokens)."""
    ids = tokenizer(text if text is not None else QUALITY_TEXT.read_text())["input_ids"]
    windows = [ids[i : i + window] for i in range(0, len(ids), window)]
    return [w for w in windows if len(w) >= 2]


def greedy_prompts(count: int = PROMPTS, text: str | None = None) -> list[str]:
    """The opening words of ``count`` of the text's sentences (spread over all of it)."""
    body = text if text is not None else QUALITY_TEXT.read_text()
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", body) if len(s.split()) > PROMPT_WORDS]
    if len(sentences) < count:
        raise ValueError(f"the text has {len(sentences)} long sentences, {count} needed")
    step = len(sentences) / count
    return [" ".join(sentences[int(i * step)].split()[:PROMPT_WORDS]) for i in range(count)]


def perplexity(engine, windows: list[list[int]], adapter: str | None) -> float:
    from loramux.engine import SamplingParams

    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    outs = engine.generate(windows, params, adapters=[adapter] * len(windows))
    nll = [-lp.logprob for out in outs for lp in out.prompt_logprobs if lp is not None]
    return math.exp(sum(nll) / len(nll))


def greedy(engine, prompts: list[str], tokens: int, adapter: str | None) -> list[list[int]]:
    from loramux.engine import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params, adapters=[adapter] * len(prompts))
    return [out.token_ids for out in outs]


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Share of runs identical to the reference's, and mean share of tokens before the first
    difference."""
    prefixes = []
    for ref, got in zip(reference, other, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), len(ref))
        prefixes.append(same / len(ref))
    return {
        "identical": round(sum(p == 1.0 for p in prefixes) / len(prefixes), 4),
        "prefix": round(sum(prefixes) / len(prefixes), 4),
    }


def measure(
    model_dir: Path,
    adapters: dict[str, Path],
    modes: tuple[Mode, ...],
    *,
    window: int,
    tokens: int,
    prompts: list[str] | None = None,
    gguf_file: Path | None = None,
    gguf_model_dir: Path | None = None,
    engine_fields: dict | None = None,
    max_windows: int | None = None,
    log=print,
) -> dict:
    """Per mode and adapter (None: the base): perplexity and greedy runs, then each mode's
    change against the first mode (the reference)."""
    from loramux.engine import Engine, EngineConfig

    prompts = prompts or greedy_prompts()
    # Prefill chunks by tokens alone (no time target): a quantized KV cache's error depends
    # on how much of the context is read back from the cache, so the chunking must not
    # follow the machine's load.
    base_fields = {"dtype": "float32", "prefill_step_target_s": math.inf, **(engine_fields or {})}
    results: dict[str, dict] = {}
    runs: dict[str, dict] = {}
    scored = None  # the reference's scored tokens
    for mode in modes:
        started = time.monotonic()
        fields = {**base_fields, **mode.engine}
        if mode.gguf:
            config = EngineConfig(model=str(gguf_model_dir), gguf_file=str(gguf_file), **fields)
        else:
            config = EngineConfig(model=str(model_dir), **fields)
        engine = Engine(config)
        for name, path in adapters.items():
            engine.add_adapter(name, path)
        windows = text_windows(engine.tokenizer, window)[:max_windows]
        scored = scored or sum(len(w) - 1 for w in windows)
        results[mode.name], runs[mode.name] = {}, {}
        for adapter in (None, *adapters):
            key = adapter or "base"
            results[mode.name][key] = {"perplexity": perplexity(engine, windows, adapter)}
            runs[mode.name][key] = greedy(engine, prompts, tokens, adapter)
        log(
            f"{mode.name}: "
            + ", ".join(f"{k} {v['perplexity']:.3f}" for k, v in results[mode.name].items())
            + f" ({time.monotonic() - started:.0f} s)"
        )
        del engine
    reference = modes[0].name
    for mode in modes:
        for key, row in results[mode.name].items():
            row["increase"] = row["perplexity"] / results[reference][key]["perplexity"] - 1.0
            row["agreement"] = agreement(runs[reference][key], runs[mode.name][key])
            row["within_limit"] = None if mode.limit is None else row["increase"] <= mode.limit
    return {
        "modes": [asdict(m) for m in modes],
        "results": results,
        "scored_tokens": scored,
        "prompts": len(prompts),
        "tokens": tokens,
        "window": window,
    }


def failed(report: dict) -> list[str]:
    """``mode/model`` for every row over its mode's limit."""
    return [
        f"{mode}/{model}"
        for mode, rows in report["results"].items()
        for model, row in rows.items()
        if row["within_limit"] is False
    ]


def render(report: dict) -> str:
    md = Markdown("Quality of the quantized modes against float32 (SmolLM2-135M-Instruct, CPU)")
    md.text(
        f"Command: `{report['command']}`. Text: `benchmarks/data/quality_text.txt`, "
        f"{report['scored_tokens']} scored tokens in windows of {report['window']}; greedy "
        f"agreement over {report['prompts']} prompts of {report['tokens']} tokens. "
        "Perplexity through the engine's own prompt scoring; modes and caveats in "
        "`benchmarks/quant_quality/runner.py`."
    )
    rows = []
    for mode in report["modes"]:
        limit = "-" if mode["limit"] is None else f"{mode['limit']:.0%}"
        for model, row in report["results"][mode["name"]].items():
            verdict = {None: "", True: " (met)", False: " (NOT met)"}[row["within_limit"]]
            agree = row["agreement"]
            rows.append(
                (
                    mode["name"],
                    model,
                    f"{row['perplexity']:.3f}",
                    f"{row['increase']:+.2%}",
                    limit + verdict,
                    f"{agree['identical']:.0%}",
                    f"{agree['prefix']:.0%}",
                )
            )
    columns = ("mode", "model", "perplexity", "change vs float32", "limit", "identical runs")
    md.table((*columns, "tokens before first difference"), rows, "lllllll")
    over = failed(report)
    return md.text(
        f"Over the limit: {over}" if over else "All within their limits.",
        "Read with care: SmolLM2's float32 weights are the de-quantized values of its Q4_1 "
        "GGUF (16 levels per group of 32), so `gguf` is the same model (the differences are "
        "float rounding) and int4 in groups of 32 nearly recovers that grid: its figure says "
        "little about 4 bits on a model never quantized. `int4-g64` re-quantizes the grid into "
        "coarser groups and is not judged. The `kv-` rows hold the KV cache's keys and values "
        "in 8 bits (a float32 scale per token and KV head) under the float32 weights, "
        "`gguf+kv-int8` under the GGUF's. Greedy runs drift apart at near-ties of a 135M "
        "model: compare the perplexities first.",
    ).render()


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--window", type=int, default=1024, help="tokens per scored window")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    add_output_options(parser)


def run(args: argparse.Namespace) -> int:
    from loramux.benchmarks.common.adapters import ALL_SEVEN, QKVO, cached_adapter
    from loramux.benchmarks.common.machine import machine_info
    from loramux.benchmarks.common.models import MODEL_NAME, prepare_model
    from loramux.engine import ModelConfig
    from loramux.engine.model.gguf_convert import extract_gguf_metadata
    from loramux.platform.base_model import embedded_gguf_path

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model_dir = prepare_model(args.cache_dir)
    config = ModelConfig.from_pretrained(model_dir)
    adapters = {
        "r8-qkvo": cached_adapter(args.cache_dir, model_dir, config, 8, QKVO, seed=1),
        "r16-all": cached_adapter(args.cache_dir, model_dir, config, 16, ALL_SEVEN, seed=2),
    }
    gguf_file = embedded_gguf_path()
    report = measure(
        model_dir,
        adapters,
        MODES,
        window=args.window,
        tokens=args.tokens,
        gguf_file=gguf_file,
        gguf_model_dir=extract_gguf_metadata(gguf_file, args.cache_dir / f"{MODEL_NAME}.metadata"),
        engine_fields={"kv_cache_bytes": 256 << 20},
    )
    report |= {"command": args.command_line, "machine": machine_info()}
    write(args.out / "quant_quality", report, render(report))
    return 1 if failed(report) else 0
