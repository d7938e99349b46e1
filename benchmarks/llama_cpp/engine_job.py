"""loramux's side of ``loramux bench llama-cpp``: one workload in a worker process.

``revisions.run_in_worker`` runs ``run_job`` in a process of its own with
``OMP_NUM_THREADS`` set to the run's threads. The engine is built as ``loramux serve``
builds it on the embedded default (``models.embedded_engine``: the GGUF's own 4-bit
weights, the engine's default settings, a KV budget that holds the longest prompt), and
driven through its Python API: ``add_request`` then ``step`` until the request or requests
end, every request greedy and exactly its length (``min_tokens`` = ``max_tokens``: EOS
suppressed, as PEFT's ``min_new_tokens`` and the llama.cpp side do). A warm-up on prompts
of its own (each adapter once, for the mixed workload) comes first.

* ``prefill``: one request of the prompt and one output token; seconds from
  ``add_request`` to the step that ends it.
* ``decode``: one request; the time each step returned a token: the seconds from the first
  token to the last.
* ``mixed``: every request added at once, each with its adapter (registered by
  ``add_adapter`` from its PEFT folder), one engine batching them continuously; seconds
  from the first ``add_request`` to the step that ends the last. With ``base_too``, the
  same prompts once more without adapters, untimed: how many outputs the adapters change.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from loramux.benchmarks.common.machine import Clock

WARMUP_PROMPT = list(range(100, 132))  # as the llama.cpp side's warm-up
WARMUP_TOKENS = 4


@dataclass
class Timed:
    """A run of requests: when it began (``perf_counter``), its seconds from the first
    ``add_request`` to the step that ended the last, each request's output, per request
    the time each of its tokens came (the step that gave it), and this process's CPU."""

    start: float
    seconds: float
    outputs: list
    stamps: list[list[float]]
    clock: dict


def _run(engine, requests: list[tuple[list[int], str | None]], max_tokens: int) -> Timed:
    """``requests`` (prompt, adapter) added at once and stepped to their end."""
    from loramux.benchmarks.common.driver_engine import exact_length_params

    params = exact_length_params(max_tokens)
    run_id = uuid.uuid4().hex[:8]  # request ids stay unique over the engine's runs
    ids = [f"{run_id}-{i}" for i in range(len(requests))]
    stamps: dict[str, list[float]] = {rid: [] for rid in ids}
    final = {}
    with Clock() as clock:
        start = time.perf_counter()
        for rid, (prompt, adapter) in zip(ids, requests, strict=True):
            engine.add_request(rid, prompt, params, adapter=adapter)
        while len(final) < len(ids):
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                stamps[out.request_id] += [now] * len(out.delta_token_ids)
                if out.finished:
                    final[out.request_id] = out
        seconds = time.perf_counter() - start
    outputs = [final[rid] for rid in ids]
    return Timed(start, seconds, outputs, [stamps[rid] for rid in ids], clock.summary())


def prefill(engine, job: dict) -> dict:
    _run(engine, [(WARMUP_PROMPT, None)], WARMUP_TOKENS)
    run = _run(engine, [(job["prompt"], None)], 1)
    return {"seconds": run.seconds, "tokens": run.outputs[0].token_ids, "clock": run.clock}


def decode(engine, job: dict) -> dict:
    _run(engine, [(WARMUP_PROMPT, None)], WARMUP_TOKENS)
    run = _run(engine, [(job["prompt"], None)], job["max_tokens"])
    [stamps] = run.stamps
    return {
        "ttft_s": stamps[0] - run.start,
        "decode_s": stamps[-1] - stamps[0],
        "tokens": run.outputs[0].token_ids,
        "clock": run.clock,
    }


def mixed(engine, job: dict) -> dict:
    for name, path in job["adapters"].items():
        engine.add_adapter(name, path)
    _run(engine, [(WARMUP_PROMPT, name) for name in job["adapters"]], WARMUP_TOKENS)
    requests = list(zip(job["prompts"], job["adapter_names"], strict=True))
    preempted = engine.num_preemptions
    run = _run(engine, requests, job["max_tokens"])
    result = {
        "seconds": run.seconds,
        "tokens": [out.token_ids for out in run.outputs],
        "clock": run.clock,
        "cached_prompt_tokens": sum(out.metrics.cached_prompt_tokens for out in run.outputs),
        "preemptions": engine.num_preemptions - preempted,
    }
    if job.get("base_too"):
        base = _run(engine, [(prompt, None) for prompt in job["prompts"]], job["max_tokens"])
        result["base_tokens"] = [out.token_ids for out in base.outputs]
    return result


WORKLOADS = {"prefill": prefill, "decode": decode, "mixed": mixed}


def run_job(job: dict) -> dict:
    """In a worker: the job's workload on the embedded default; its figures and tokens."""
    import torch

    from loramux.benchmarks.common.models import LONG_CONTEXT_KV_BYTES, embedded_engine

    torch.set_num_threads(job["threads"])
    engine = embedded_engine(Path(job["scratch"]), kv_cache_bytes=LONG_CONTEXT_KV_BYTES)
    try:
        result = WORKLOADS[job["workload"]](engine, job)
        config = engine.config
        result["engine_settings"] = {
            "kernels": engine.backend.name,
            "lora_op": getattr(engine.backend, "lora_op", None),
            "speculative": config.speculative_method,
            "max_num_seqs": config.max_num_seqs,
            "kv_cache_bytes": config.kv_cache_bytes,
            # After the run: the engine's governor takes threads back while other processes
            # hold cores (compute_threads.py), so fewer than asked says the machine was busy.
            "torch_threads": torch.get_num_threads(),
        }
    finally:
        engine.close()
    return result
