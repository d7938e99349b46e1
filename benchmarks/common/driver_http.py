"""Serve a workload open-loop against a running loramux platform, over its OpenAI API.

Each request is a streamed ``POST /v1/completions`` sent with the official ``openai``
client (``max_retries=0``: a failure is recorded, never retried), the prompt given as
token ids, greedy (``temperature=0``), ``max_tokens = output_len``.

Rules:

* times are seconds from the run's start (``time.perf_counter() - t0``); ``arrival_s``
  comes from the workload;
* open loop: the calling thread sleeps until each request's arrival and hands it to a
  pool of ``max_workers`` threads; ``sent_s`` is when a worker starts the HTTP call, so a
  pool too small for the load shows up as ``sent_s > arrival_s``, not as a slower server;
* tokens: the platform sends one SSE chunk per engine output, i.e. one token per chunk,
  and each chunk's tokens are stamped when the client receives it. The count is settled
  by the usage the stream ends with (``stream_options.include_usage``): should a chunk
  ever carry several tokens (fewer chunks than ``usage.completion_tokens``), the missing
  tokens are stamped with the last chunk's time (the earliest the client saw them all);
  an empty-text chunk still counts (a token may decode to no text yet);
* ``finish_s`` is when the stream ended; an error is ``"HTTP <status>: <message>"`` for a
  refused request, ``"stream error: <message>"`` for an error sent mid-stream, else the
  exception's type and message, with ``finish_s`` at that moment.

Every request asks for exactly ``output_len`` tokens through the platform's extensions
(``min_tokens`` = ``max_tokens``, sent in ``extra_body``: EOS suppressed, as the other
drivers do); ``extra_body`` adds to (or overrides) them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from loramux.benchmarks.common.measures import RequestRecord, new_records
from loramux.benchmarks.common.workload import WorkloadRequest


def _error_text(exc: Exception) -> str:
    import openai

    if isinstance(exc, openai.APIStatusError):
        return f"HTTP {exc.status_code}: {exc.message}"
    if isinstance(exc, openai.APIError):
        return f"stream error: {exc.message}"
    return f"{type(exc).__name__}: {exc}"


def _settle_token_times(times: list[float], usage_tokens: int | None) -> list[float]:
    """Chunk stamps reconciled with the usage count (see the module docstring)."""
    if usage_tokens is None or usage_tokens == len(times):
        return times
    if usage_tokens < len(times):
        return times[:usage_tokens]
    last = times[-1] if times else None
    return times + [last] * (usage_tokens - len(times)) if last is not None else times


def run_http(
    base_url: str,
    api_keys: dict[str, str],
    requests: Sequence[WorkloadRequest],
    prompts: dict[int, list[int]],
    model_names: list[str | None],
    *,
    base_model: str,
    max_workers: int = 64,
    timeout_s: float = 600.0,
    extra_body: dict[str, Any] | None = None,
    texts: dict[int, str] | None = None,
    finish_reasons: dict[int, str | None] | None = None,
) -> list[RequestRecord]:
    """Serve ``requests`` on the platform at ``base_url``; one record per request, in order.

    ``api_keys`` maps a tenant to its API key (a request of a tenant not listed is an
    error record). ``model_names[k]`` is the ``model`` of workload adapter ``k`` (the
    name the tenant gave it); a request with ``adapter=None``, or whose entry is None,
    asks for ``base_model``. ``texts`` and ``finish_reasons``, when given, are filled per
    request index with the streamed text and the finish reason.
    """
    import openai

    clients = {
        tenant: openai.OpenAI(
            base_url=f"{base_url.rstrip('/')}/v1", api_key=key, max_retries=0, timeout=timeout_s
        )
        for tenant, key in api_keys.items()
    }
    records = new_records(requests, prompts)
    texts = texts if texts is not None else {}
    reasons = finish_reasons if finish_reasons is not None else {}
    lock = threading.Lock()  # guards the shared texts / reasons dicts
    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    def serve(request: WorkloadRequest) -> None:
        record = records[request.index]
        model = None if request.adapter is None else model_names[request.adapter]
        times: list[float] = []
        text: list[str] = []
        reason = None
        usage_tokens = None
        record.sent_s = now()
        try:
            client = clients.get(request.tenant)
            if client is None:
                raise KeyError(f"no API key for tenant {request.tenant!r}")
            stream = client.completions.create(
                model=model or base_model,
                prompt=prompts[request.index],
                max_tokens=request.output_len,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={
                    "min_tokens": request.output_len,
                    **(extra_body or {}),
                },
            )
            with stream:
                for chunk in stream:
                    stamp = now()
                    for choice in chunk.choices:
                        times.append(stamp)
                        text.append(choice.text or "")
                        reason = choice.finish_reason or reason
                    if chunk.usage is not None:
                        usage_tokens = chunk.usage.completion_tokens
        except Exception as exc:
            record.error = _error_text(exc)
        record.finish_s = now()
        record.token_times_s = _settle_token_times(times, usage_tokens)
        with lock:
            texts[request.index] = "".join(text)
            reasons[request.index] = reason

    pending = sorted(requests, key=lambda r: (r.arrival_s, r.index))
    with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="bench-http") as pool:
        futures = []
        for request in pending:
            delay = request.arrival_s - now()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(serve, request))
        for future in futures:
            future.result()  # serve() records its own errors; this re-raises only bugs
    for client in clients.values():
        client.close()
    return [records[r.index] for r in requests]
