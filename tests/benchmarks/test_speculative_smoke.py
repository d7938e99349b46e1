"""``loramux bench speculative --smoke``: the preset's whole run for a few seconds on SmolLM2.

Both engines (speculation off and n-gram) serve the first copy and chat request at batch 1
for 8 tokens, through the console entry point, and write the report and the plot. The
times of so short a run mean nothing and are not asserted; what is: the report's shape,
that both engines produced the same token ids, that the engine's counters agree with the
requests' metrics, and that speculation proposed and had accepted tokens on the copy
workload (SmolLM2 starts copying its passage at once; the tiny random model copies
nothing, so the smoke runs on SmolLM2).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from loramux.benchmarks.serve.presets import PRESETS, Baseline
from loramux.benchmarks.speculative import runner as speculative
from tests.benchmarks.commands import loramux


def test_the_preset_runs_the_same_engine_with_and_without_ngram_speculation():
    preset = PRESETS["speculative"]
    assert preset.baseline is Baseline.SPECULATION_OFF and preset.device == "cpu"
    assert preset.engine["speculative_method"] == "ngram"
    assert preset.engine["enable_prefix_caching"] is False
    goals = {g.metric: (g.value, g.at_most) for g in preset.goals}
    assert goals == {"copy_speedup": (1.5, False), "chat_speedup": (0.95, False)}
    assert speculative.requests_of(1, 5) == [1]
    assert speculative.requests_of(4, 1) == [0, 1, 2, 3, 0, 1, 2, 3]  # 2 per slot


class _CountingEngine:
    """Finishes each request after as many steps as its text says; counts how many run."""

    def __init__(self):
        self.running: dict[str, int] = {}
        self.most_running = 0

    def add_request(self, request_id, text, params):
        self.running[request_id] = int(text)
        self.most_running = max(self.most_running, len(self.running))

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        outs = []
        for rid in list(self.running):
            self.running[rid] -= 1
            finished = self.running[rid] == 0
            if finished:
                del self.running[rid]
            outs.append(SimpleNamespace(request_id=rid, finished=finished))
        return outs


def test_serve_keeps_the_slots_full_and_returns_outputs_in_order():
    engine = _CountingEngine()
    outs = speculative.serve(engine, ["3", "1", "2", "5", "1"], None, in_flight=2)
    assert engine.most_running == 2
    assert all(o.finished for o in outs) and len({o.request_id for o in outs}) == 5
    first = int(outs[0].request_id.split("-")[1])
    assert [int(o.request_id.split("-")[1]) - first for o in outs] == [0, 1, 2, 3, 4]


def test_the_smoke_reports_both_engines_and_what_speculation_did(smollm2_dir, tmp_path):
    done = loramux(
        "bench", "speculative", "--smoke", "--threads", "1", "--model", str(smollm2_dir),
        "--out", str(tmp_path), timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "bench_speculative-smoke.json").read_text())
    assert report["smoke"] is True and report["warmup"] is False
    assert report["outputs_identical"] is True and report["counters_agree"] is True
    assert report["engine_configs"]["off"]["speculative_method"] == "off"
    assert report["engine_configs"]["ngram"]["speculative_method"] == "ngram"
    assert {"machine", "contention", "prompt_tokens", "command", "results"} <= set(report)

    summaries = {s["workload"]: s for s in report["summaries"]}
    assert set(summaries) == {"copy", "chat"}
    for s in summaries.values():
        assert s["batch"] == 1 and s["pairs"] == 1 and s["outputs_match"]
        assert s["off_tokens_per_s"] > 0 and s["ngram_tokens_per_s"] > 0 and s["speedup"] > 0
        assert s["decode_speedup"] > 0 and 0 < s["prefill_share_off"] < 1
    copy = summaries["copy"]
    assert copy["proposed"] > 0 and copy["accepted"] > 0
    assert copy["tokens_per_step"] > 1 and copy["off_tokens_per_step"] == 1

    [copy_run] = next(r for r in report["results"] if r["workload"] == "copy")["pairs"]
    assert copy_run["outputs_match"] and copy_run["mismatches"] == []
    assert copy_run["off"]["proposed"] == 0  # speculation off proposes nothing
    for name in ("off", "ngram"):
        run = copy_run[name]
        assert run["tokens"] == 8 and run["seconds"] > 0 and run["cores_used"] > 0
        assert 0 < run["prefill_seconds"] < run["seconds"] and run["decode_tokens_per_s"] > 0
        assert run["engine_steps"] > run["engine_decode_steps"] > 0
        assert run["ms_per_decode_step"] > 0
        assert run["counters"]["adapter_generated_tokens"] == run["tokens"]
    ngram_ids = [q["ids_sha1"] for q in copy_run["ngram"]["requests"]]
    assert ngram_ids == [q["ids_sha1"] for q in copy_run["off"]["requests"]]

    goals = report["goals"]
    assert {(g["batch"], g["metric"]) for g in goals} == {(1, "copy_speedup"), (1, "chat_speedup")}
    assert all(g["met"] is None and g["verdict"].startswith("not judged") for g in goals)

    markdown = (tmp_path / "bench_speculative-smoke.md").read_text()
    assert markdown in done.stdout and "FAILED" not in markdown
    assert "| copy | 1 | 1 |" in markdown and "**Goal at batch 1: copy speedup ≥ 1.5" in markdown
    assert (tmp_path / "bench_speculative-smoke.png").stat().st_size > 10_000
