"""``loramux bench quantized-serve``'s arithmetic: medians per mode, ratios, text agreement
between the modes of a pair, and the table (the runs themselves start real servers: the
recorded ``benchmarks/results/bench_quantized-serve.md``)."""

from __future__ import annotations

from loramux.benchmarks.common.machine import machine_info
from loramux.benchmarks.quantized_serve import runner as quantized_serve


def _run(mode: str, rss: float, b1: float, b4: float, texts: list[str]) -> dict:
    throughput = {"seconds": 1.0, "tokens": 8, "texts": texts}
    return {
        "mode": mode,
        "ready_s": 2.0,
        "rss_ready_mib": rss - 10,
        "rss_loaded_mib": rss,
        "rss_peak_mib": rss + 5,
        "model_cache_mib": 3.0 if mode == "gguf" else 500.0,
        "batch1": {**throughput, "tokens_per_s": b1},
        "batch4": {**throughput, "tokens_per_s": b4},
    }


def test_medians_ratios_and_agreement():
    runs = [
        _run("gguf", 600, 30, 80, ["a", "b"]),
        _run("float32", 1000, 15, 40, ["a", "c"]),
        _run("gguf", 640, 34, 60, ["a", "b"]),
        _run("float32", 1100, 17, 50, ["a", "b"]),
    ]
    summary = quantized_serve.summarize(runs)
    assert summary["gguf"]["rss_loaded_mib"] == 620
    assert summary["float32"]["batch1_tokens_per_s"] == 16
    assert summary["ratios"]["rss_loaded"] == round(620 / 1050, 3)
    assert summary["ratios"]["batch4_speedup"] == round(70 / 45, 3)
    # per pair, batch 1 and batch 4 each compare two texts; the first pair differs in one
    # text of each
    assert quantized_serve.agreement(runs) == {"same_text": 6, "requests": 8}
    report = {
        "command": "x",
        "machine": machine_info(),
        "repeats": 2,
        "tokens": 8,
        "runs": runs,
        "summary": summary,
        "agreement": quantized_serve.agreement(runs),
    }
    text = quantized_serve.render(report)
    assert "| output tokens/s, batch 1 | 32.0 | 16.0 | 2.00x |" in text
    assert "Same text in both modes: 6 of 8 requests." in text
