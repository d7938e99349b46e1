"""The benchmark drivers: serve one workload on a system and record what each request saw.

Every driver serves the same list of ``workload.WorkloadRequest`` with the same prompt
token ids (``prompts``: request index -> ids), greedy, and returns one
``measures.RequestRecord`` per request, in the order of ``requests``:

* ``run_engine`` (``driver_engine``): the loramux engine in-process, open loop;
* ``run_http`` (``driver_http``): a running loramux platform over its OpenAI API with the
  official ``openai`` client, open loop from a thread pool;
* ``run_peft_baseline`` (``driver_peft``): transformers + PEFT, static mixed-adapter
  batches.

Shared rules: times are seconds from the run's start (``time.perf_counter() - t0``);
``arrival_s`` is the workload's, ``sent_s`` when the system was handed the request,
``token_times_s`` one stamp per generated token, ``finish_s`` when the request ended;
errors are recorded on the request, never raised. The engine and PEFT drivers produce
exactly ``output_len`` tokens per request (EOS suppressed); over HTTP the platform does
not accept ``min_tokens``/``ignore_eos``, so a request may stop early at EOS. Each
module's docstring gives its own rules and extras (``token_ids=``, ``texts=``...).
"""

from __future__ import annotations

from loramux.benchmarks.common.driver_engine import exact_length_params, run_engine
from loramux.benchmarks.common.driver_http import run_http
from loramux.benchmarks.common.driver_peft import BASE_ADAPTER, run_peft_baseline

__all__ = ["BASE_ADAPTER", "exact_length_params", "run_engine", "run_http", "run_peft_baseline"]
