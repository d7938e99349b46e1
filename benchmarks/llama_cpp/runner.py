"""``loramux bench llama-cpp``: the embedded default against llama.cpp on the same GGUF
(SmolLM2-135M-Instruct Q4_1): prefill, batch-1 decode, and 16 requests over 8 adapters.

Each engine run is a process of its own with ``--threads`` threads: loramux's a worker
(``revisions.run_in_worker``, ``engine_job.py``: the engine as ``loramux serve`` builds it
on the embedded default), llama.cpp's the script ``llama_worker.py`` run by
``--llama-cpp-python``'s interpreter (llama-cpp-python's low-level API). For ``--rounds``
rounds, workload by workload, loramux and llama.cpp take turns, the order flipping each
round, so that a busy moment of the machine falls on both; the figures are the medians over
the rounds and the ratio is loramux's median over llama.cpp's. Both get the same token ids.

* **prefill**: one request of ``--prefill-tokens`` random token ids (a fresh prompt each
  round: no prefix-cache hit) and one output token; prompt tokens/s.
* **decode**: one request, greedy, a chat prompt and ``--decode-tokens`` new tokens (EOS
  suppressed); decode tokens/s = (new tokens - 1) / the seconds after the first token.
* **mixed**: 16 chat requests on 8 distinct random LoRA adapters (2 each; ranks 8 and 16 on
  q, k, v, o, gate, up, down), ``--mixed-tokens`` greedy tokens each, all submitted at once:
  loramux batches them continuously in one engine; llama.cpp holds them in one context of
  16 sequences and decodes, at each step, each adapter's group with that adapter set (what
  its server does for slots with different LoRAs), the adapters converted to llama.cpp's
  GGUF LoRA (``gguf_lora.py``). Output tokens/s = all new tokens / the seconds from submit
  to the last token.

Exactness first: loramux's mixed tokens must equal transformers + PEFT's greedy tokens, one
request at a time, on the GGUF's de-quantized float32 weights with the same adapters; a
difference fails the study (exit 1, after the report is written). llama.cpp's tokens are
compared with PEFT's and reported, not asserted (its matmuls quantize the activations).
Without llama.cpp (no interpreter that imports ``llama_cpp``), loramux alone is measured,
the report and stderr say so and how to install it, and the study exits 0.

Writes ``<out>/llama_cpp_cpu[_TAG].{json,md,png}``; the recorded results are
``loramux bench llama-cpp`` with its defaults.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from loramux.benchmarks.common import revisions
from loramux.benchmarks.common.adapters import ALL_SEVEN, AdapterSpec
from loramux.benchmarks.common.files import add_output_options, check_output_options
from loramux.benchmarks.common.llama_cpp_python import (
    CMAKE_ARGS,
    INSTALL,
    LlamaCpp,
    find_llama_cpp,
    run_script,
)
from loramux.benchmarks.common.machine import contention, machine_info
from loramux.benchmarks.common.report import write
from loramux.benchmarks.llama_cpp import engine_job, report

NAME = "llama_cpp_cpu"
WORKLOADS = ("prefill", "decode", "mixed")
LLAMA_WORKER = Path(__file__).with_name("llama_worker.py")
MIXED_REQUESTS = 16
MIXED_ADAPTERS = 8  # request i uses adapter i % 8: two requests each
ADAPTER_SHAPES = ((8, ALL_SEVEN), (16, ALL_SEVEN))  # adapter i: ADAPTER_SHAPES[i % 2]
ADAPTER_SEED = 1000  # adapter i's seed is 1000 + i (the other studies' cache is shared)
MAX_PREFILL_TOKENS = 8000  # the engine's KV budget holds this (common.models.LONG_CONTEXT_KV_BYTES)


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=WORKLOADS,
        default=list(WORKLOADS),
        help="which to measure (default: all three)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="turns of each engine (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="each engine's (default 2)")
    parser.add_argument("--prefill-tokens", type=int, default=2000, help="the prompt's length")
    parser.add_argument("--decode-tokens", type=int, default=128, help="new tokens at batch 1")
    parser.add_argument("--mixed-tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--tag", help="results named llama_cpp_cpu_TAG (default llama_cpp_cpu)")
    parser.add_argument(
        "--llama-cpp-python",
        type=Path,
        help="a Python interpreter that imports llama_cpp (default: this one, where it does)",
    )
    add_output_options(parser)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_output_options(parser, args)
    args.workloads = list(dict.fromkeys(args.workloads))
    counts = ("rounds", "threads", "prefill_tokens", "mixed_tokens")
    bad = ["--" + name.replace("_", "-") for name in counts if getattr(args, name) < 1]
    if bad:
        parser.error(f"{', '.join(bad)} must be positive")
    if args.decode_tokens < 2:
        parser.error("--decode-tokens must be at least 2 (decode speed is timed after the first)")
    if args.prefill_tokens > MAX_PREFILL_TOKENS:
        parser.error(f"--prefill-tokens must be at most {MAX_PREFILL_TOKENS:,}")


# --- the workloads ---------------------------------------------------------------------


@dataclass
class Work:
    """What both engines serve, as token ids and files."""

    gguf: Path
    scratch: Path  # the workers' (the embedded GGUF's metadata is extracted there)
    threads: int
    suppress: list[int]  # the model's EOS ids: every request runs its full length
    prefill_prompts: list[list[int]]  # one per round
    decode_prompt: list[int]
    decode_tokens: int
    mixed_prompts: list[list[int]]
    mixed_tokens: int
    adapters: list[AdapterSpec]  # PEFT folders
    adapter_files: list[Path]  # the same adapters as GGUF LoRA files
    adapter_of: list[int]  # per mixed request: its adapter
    reference: list[list[int]]  # transformers + PEFT's tokens per mixed request

    def loramux_job(self, workload: str, round_: int) -> dict:
        job = self._job(workload, round_) | {"runner": engine_job.__name__}
        if workload == "mixed":
            job["adapters"] = {a.name: str(a.path) for a in self.adapters}
            job["adapter_names"] = [self.adapters[k].name for k in self.adapter_of]
            job["base_too"] = round_ == 0  # do the adapters change the outputs?
        return job | {"scratch": str(self.scratch)}

    def llama_job(self, workload: str, round_: int) -> dict:
        job = self._job(workload, round_) | {"gguf": str(self.gguf), "suppress": self.suppress}
        if workload == "mixed":
            job["adapter_files"] = [str(self.adapter_files[k]) for k in self.adapter_of]
        return job

    def _job(self, workload: str, round_: int) -> dict:
        job = {"workload": workload, "threads": self.threads}
        if workload == "prefill":
            return job | {"prompt": self.prefill_prompts[round_]}
        if workload == "decode":
            return job | {"prompt": self.decode_prompt, "max_tokens": self.decode_tokens}
        return job | {"prompts": self.mixed_prompts, "max_tokens": self.mixed_tokens}


def prepare(args: argparse.Namespace, scratch: Path) -> Work:
    """The prompts; for the mixed workload the adapters, as PEFT folders and GGUF LoRA files
    (cached), and transformers + PEFT's tokens."""
    from transformers import AutoTokenizer

    from loramux.benchmarks.common.prompts import Prompts, chat_prompts
    from loramux.engine.model.config import ModelConfig
    from loramux.engine.model.gguf_convert import extract_gguf_metadata
    from loramux.platform.base_model import embedded_gguf_path

    gguf = embedded_gguf_path()
    meta = extract_gguf_metadata(gguf, scratch / "meta", log=lambda *a: None)
    config = ModelConfig.from_pretrained(meta)
    tokenizer = AutoTokenizer.from_pretrained(meta)
    fresh = Prompts(config.vocab_size, config.eos_token_ids, seed=args.prefill_tokens)
    work = Work(
        gguf=gguf,
        scratch=scratch,
        threads=args.threads,
        suppress=list(config.eos_token_ids),
        prefill_prompts=[fresh(args.prefill_tokens) for _ in range(args.rounds)],
        decode_prompt=chat_prompts(tokenizer, 1)[0],
        decode_tokens=args.decode_tokens,
        mixed_prompts=chat_prompts(tokenizer, MIXED_REQUESTS),
        mixed_tokens=args.mixed_tokens,
        adapters=[],
        adapter_files=[],
        adapter_of=[i % MIXED_ADAPTERS for i in range(MIXED_REQUESTS)],
        reference=[],
    )
    if "mixed" in args.workloads:
        _prepare_adapters(work, args.cache_dir, config)
    return work


def _prepare_adapters(work: Work, cache_dir: Path, config) -> None:
    from loramux.benchmarks.common.adapters import prepare_adapters
    from loramux.benchmarks.common.models import prepare_model
    from loramux.benchmarks.llama_cpp.gguf_lora import cached_gguf_lora

    model_dir = prepare_model(cache_dir)  # the GGUF de-quantized: what PEFT runs
    work.adapters = prepare_adapters(
        cache_dir, model_dir, ADAPTER_SHAPES, MIXED_ADAPTERS, seed=ADAPTER_SEED
    )
    work.adapter_files = [
        cached_gguf_lora(cache_dir, model_dir, a.path, config) for a in work.adapters
    ]
    print("transformers + PEFT's greedy tokens, one request at a time ...", flush=True)
    work.reference = peft_reference(
        model_dir, work.adapters, work.mixed_prompts, work.adapter_of, work.mixed_tokens
    )


def peft_reference(model_dir: Path, adapters, prompts, adapter_of, max_tokens: int):
    """transformers + PEFT's greedy tokens of each request run alone (batches of one: no
    padding), EOS suppressed; in request order."""
    from loramux.benchmarks.common.driver_peft import run_peft_baseline
    from loramux.benchmarks.common.workload import WorkloadRequest

    requests = [
        WorkloadRequest(i, 0.0, adapter_of[i], len(prompt), max_tokens, "bench")
        for i, prompt in enumerate(prompts)
    ]
    tokens: dict[int, list[int]] = {}
    records = run_peft_baseline(
        model_dir,
        [a.path for a in adapters],
        requests,
        dict(enumerate(prompts)),
        batch_size=1,
        token_ids=tokens,
    )
    failed = [r.error for r in records if r.error]
    if failed:
        raise RuntimeError(f"transformers + PEFT failed: {failed[0]}")
    return [tokens[i] for i in range(len(prompts))]


# --- the runs --------------------------------------------------------------------------


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """How far ``tokens`` follow ``reference``: requests identical, and tokens before each
    request's first difference (after one, greedy decoding goes its own way)."""

    def common(a: list[int], b: list[int]) -> int:
        return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(b))

    return {
        "requests_identical": sum(a == b for a, b in zip(tokens, reference, strict=True)),
        "requests": len(reference),
        "tokens_matching": sum(common(a, b) for a, b in zip(tokens, reference, strict=True)),
        "tokens": sum(map(len, reference)),
    }


def make_row(engine: str, workload: str, round_: int, result: dict, work: Work) -> dict:
    """One engine's figures for one workload in one round (printed as they come)."""
    row = {"engine": engine, "workload": workload, "round": round_, "clock": result["clock"]}
    if workload == "prefill":
        tokens, seconds = len(work.prefill_prompts[round_]), result["seconds"]
    elif workload == "decode":
        tokens, seconds = len(result["tokens"]) - 1, result["decode_s"]
        row |= {"ttft_s": round(result["ttft_s"], 4), "token_ids": result["tokens"]}
    else:
        tokens, seconds = sum(map(len, result["tokens"])), result["seconds"]
        row["agreement"] = agreement(result["tokens"], work.reference)
        for name in ("cached_prompt_tokens", "preemptions", "n_ctx", "groups"):
            if name in result:
                row[name] = result[name]
        if "base_tokens" in result:  # how many outputs the adapters change
            row["differ_from_base"] = sum(
                a != b for a, b in zip(result["base_tokens"], work.reference, strict=True)
            )
    row |= {"tokens": tokens, "seconds": round(seconds, 4)}
    row["tokens_per_s"] = round(tokens / seconds, 2)
    for name in ("engine_settings", "flash_attn"):
        if name in result:
            row[name] = result[name]
    print({k: v for k, v in row.items() if k != "token_ids"}, flush=True)
    return row


def measure(
    work: Work, args, llama: LlamaCpp | None, checkout: revisions.Checkout, workdir: Path
) -> list[dict]:
    """Round by round, workload by workload, each engine in a process of its own, the order
    flipping each round."""
    rows = []
    for round_ in range(args.rounds):
        for workload in args.workloads:
            engines = ["loramux", "llama.cpp"] if llama is not None else ["loramux"]
            for engine in engines[:: -1 if round_ % 2 else 1]:
                if engine == "loramux":
                    job = work.loramux_job(workload, round_)
                    result = revisions.run_in_worker(checkout, job, workdir)
                else:
                    assert llama is not None
                    job = work.llama_job(workload, round_)
                    result = run_script(llama.python, LLAMA_WORKER, job, workdir, args.threads)
                rows.append(make_row(engine, workload, round_, result, work))
    return rows


# --- the verdicts ----------------------------------------------------------------------


def summarize(rows: list[dict], workloads: list[str]) -> list[dict]:
    """Per workload: each engine's median tokens/s over the rounds, and loramux's over
    llama.cpp's."""
    summary = []
    for workload in workloads:
        medians = {}
        for engine in ("loramux", "llama.cpp"):
            speeds = [
                r["tokens_per_s"]
                for r in rows
                if (r["workload"], r["engine"]) == (workload, engine)
            ]
            medians[engine] = round(statistics.median(speeds), 2) if speeds else None
        lm, lc = medians["loramux"], medians["llama.cpp"]
        summary.append(
            {
                "workload": workload,
                "loramux_tokens_per_s": lm,
                "llama_cpp_tokens_per_s": lc,
                "ratio": round(lm / lc, 3) if lm and lc else None,
            }
        )
    return summary


def checks(rows: list[dict], work: Work) -> dict:
    """loramux's mixed tokens against PEFT's (the study's pass or fail), llama.cpp's (told),
    how many outputs the adapters change, and llama.cpp's decode tokens against loramux's."""
    mixed = {
        e: [r for r in rows if (r["workload"], r["engine"]) == ("mixed", e)]
        for e in ("loramux", "llama.cpp")
    }
    found = {}
    if mixed["loramux"]:
        found["loramux_matches_peft"] = all(
            r["agreement"]["requests_identical"] == r["agreement"]["requests"]
            for r in mixed["loramux"]
        )
        base = [r["differ_from_base"] for r in mixed["loramux"] if "differ_from_base" in r]
        found["adapters_change_outputs"] = (
            {"requests": base[0], "of": len(work.reference)} if base else None
        )
    if mixed["llama.cpp"]:
        found["llama_cpp_against_peft"] = mixed["llama.cpp"][0]["agreement"]
    decode = {(r["engine"], r["round"]): r["token_ids"] for r in rows if r["workload"] == "decode"}
    pairs = [
        agreement([decode[("llama.cpp", k)]], [decode[("loramux", k)]])
        for (engine, k) in decode
        if engine == "llama.cpp" and ("loramux", k) in decode
    ]
    if pairs:
        found["llama_cpp_decode_against_loramux"] = pairs[0]
    return found


def run(args: argparse.Namespace) -> int:
    import torch

    llama, why = find_llama_cpp(args.llama_cpp_python)
    skipped = f"llama.cpp skipped: {why}. Install it with {INSTALL}."
    if llama is None:
        print(skipped, file=sys.stderr)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the loramux workers'
    torch.set_num_threads(args.threads)  # PEFT's reference, here
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="loramux-llama-cpp-") as tmp:
        workdir = Path(tmp)
        work = prepare(args, workdir)
        rows = measure(work, args, llama, revisions.after_checkout(workdir), workdir)
    result = build_report(args, work, rows, machine)
    result["llama_cpp"] = (
        llama.to_json() | {"cmake_args": CMAKE_ARGS}
        if llama is not None
        else {"skipped": why, "install": INSTALL}
    )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (NAME if args.tag is None else f"{NAME}_{args.tag}")
    write(stem, result, report.markdown(result, report.write_plot(result, stem)))
    if llama is None:
        print(skipped, file=sys.stderr)  # again, below the report
    if result["checks"].get("loramux_matches_peft") is False:
        print("loramux's mixed-adapter tokens differ from transformers + PEFT's", file=sys.stderr)
        return 1
    return 0


def build_report(args: argparse.Namespace, work: Work, rows: list[dict], machine: dict) -> dict:
    """Everything the JSON keeps, but llama.cpp's own description."""
    adapters = [{"name": a.name, "rank": a.rank, "targets": list(a.targets)} for a in work.adapters]
    return {
        "name": NAME,
        "command": args.command_line,
        "gguf": work.gguf.name,
        "threads": args.threads,
        "rounds": args.rounds,
        "workloads": {
            "prefill": {"prompt_tokens": args.prefill_tokens},
            "decode": {"prompt_tokens": len(work.decode_prompt), "new_tokens": args.decode_tokens},
            "mixed": {
                "requests": MIXED_REQUESTS,
                "adapters": adapters,
                "prompt_tokens": [len(p) for p in work.mixed_prompts],
                "new_tokens": args.mixed_tokens,
            },
        },
        "machine": machine,
        **contention([r["clock"] for r in rows], machine),
        "summary": summarize(rows, args.workloads),
        "checks": checks(rows, work),
        "rows": rows,
    }
