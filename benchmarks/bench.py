"""``loramux bench NAME [options]``: every benchmark study under one command.

Each study is a ``Study`` (``common/study.py``): its name, a line saying what it
measures, and its runner module, imported only when it runs. The presets that serve a
workload against transformers + PEFT (``cpu-smoke``, and on a GPU ``slora-s1``,
``slora-s2``, ``punica-distinct``) share the ``serve`` runner; every other name is a
study of its own. ``loramux bench -h`` lists them, ``loramux bench NAME -h`` gives a
study's options. ``python -m loramux.benchmarks.bench NAME ...`` is the same.
"""

from __future__ import annotations

import sys

from loramux.benchmarks.common.study import Study


def _study(name: str, summary: str, package: str | None = None, **defaults) -> Study:
    package = package or name.replace("-", "_")
    return Study(name, summary, f"loramux.benchmarks.{package}.runner", defaults)


def _preset(name: str, summary: str) -> Study:
    return _study(name, summary, "serve", preset=name)


STUDIES = {
    study.name: study
    for study in (
        _preset("cpu-smoke", "loramux against transformers + PEFT on a small two-tenant workload"),
        _preset("slora-s1", "S-LoRA's S1 at Llama-7B shapes against transformers + PEFT (GPU)"),
        _preset("slora-s2", "S-LoRA's S2 at Llama-7B shapes against transformers + PEFT (GPU)"),
        _preset("punica-distinct", "Punica's distinct-adapter case at Llama-7B shapes (GPU)"),
        _study("lora-overhead", "16 distinct adapters against the base model on one engine"),
        _study("engine-vs-peft", "the engine's tokens/s against PEFT's mixed-adapter generate"),
        _study("adapter-churn", "inter-token latency with far more adapters than their tiers hold"),
        _study("cold-adapter-flood", "a cold adapter's first token while another tenant holds KV"),
        _study("fairness-slo", "weighted fair share, priority and deadlines under overload"),
        _study("prefill-flood", "how long one tenant's prompts hold another's first token"),
        _study("prefill-cpu", "the embedded default's prefill speed, against llama.cpp"),
        _study(
            "llama-cpp",
            "the embedded default against llama.cpp on the same GGUF: prefill, batch-1 "
            "decode, 8 adapters",
        ),
        _study("speculative", "what n-gram speculation gains where answers copy, and costs"),
        _study("quantized-serve", "loramux serve on the GGUF's 4-bit weights against float32"),
        _study("quant-quality", "perplexity and agreement of each quantized mode against float32"),
        _study("tensor-parallel", "one engine over two processes against one process"),
        _study("grammar-engines", "xgrammar, llguidance and outlines-core on SmolLM2's vocabulary"),
        _study("grammar-cache-memory", "the memory compiled grammars keep, and the cache's bound"),
        _study("structured-overhead", "a strict json_schema's cost per output token"),
        _study("soak", "a real loramux serve under steady load and adapter churn for minutes"),
        _study("simulate", "S-LoRA's workloads and the recorded GPU runs on a simulated GPU"),
        _study("kernels-gpu", "the Triton kernels and whole steps against their floors (GPU)"),
        _study("gpu-check", "everything only a GPU can tell, in one command within a budget"),
    )
}


def study(name: str) -> Study:
    return STUDIES[name]


def usage() -> str:
    width = max(map(len, STUDIES))
    rows = "\n".join(f"  {name:<{width}}  {s.summary}" for name, s in STUDIES.items())
    return (
        "usage: loramux bench NAME [options]   (loramux bench NAME -h: its options)\n\n"
        f"Benchmark studies; each writes its results into benchmarks/results/:\n{rows}\n"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] not in STUDIES:
        print(f"loramux bench: no study named {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return STUDIES[argv[0]].main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
