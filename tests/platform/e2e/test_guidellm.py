"""GuideLLM against ``loramux serve``, as a tenant load-testing its adapter.

``guidellm run`` (the vLLM project's load generator, 0.8.1 as pinned in the dev extra) runs
as a subprocess with its ``openai_http`` backend: it probes ``GET /health`` (vLLM's route)
with the tenant's key as a bearer token, then streams synthetic prompts of a fixed token
length to the tenant's adapter with ``ignore_eos`` and ``max_tokens`` (``max_output_tokens``
on the Responses API), two at a time, and reads each request's token counts from the
``usage`` the server streams last. Three runs, over completions, chat and the Responses
API, go at once (the server batches them together; one after the other they would take
three times the decode steps), each tagging its requests with its own ``user``. The
options are GuideLLM's registry options, each given as a JSON object (the same parser as
``kind=...,key=value``, with no quoting questions). GuideLLM gets the converted SmolLM2
folder as its tokenizer and runs offline (no hub).

Every request must succeed (none errored or incomplete), and the tokens GuideLLM counted,
request by request (matched by the response id, which is loramux's request id), must equal
loramux's own usage records, as the operator's usage export reports them.

GuideLLM 0.8.1 can stall inside its own multiprocess scheduler: in CI one run stopped
logging after 3 of its 4 requests and wrote no report until the 600 s deadline killed it.
A run that has written no report ``STALL_S`` after loramux finished (and billed) every one
of its requests is such a stall: loramux did its part, which is checked there (each of
those requests billed once, at its full output), and the run is started again once under a
new ``user``. A run whose requests loramux never finished is still a failure.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.platform.e2e.serve_process import ServeProcess
from tests.platform.e2e.served_smollm2 import serve_with_adapter

pytestmark = pytest.mark.slow

ADAPTER = "guidellm-adapter"
REQUEST_FORMATS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
REQUESTS = 4  # per run
STREAMS = 2  # each run's concurrency
PROMPT_TOKENS = 32  # of synthetic text, before any chat template
OUTPUT_TOKENS = 16
RUNS_TIMEOUT_S = 600.0
STALL_S = 90.0  # no report this long after loramux billed all of a run's requests: stalled
ATTEMPTS = 2  # per request format
SERVED_POLL_S = 5.0  # how often a waiting run reads loramux's usage export
EXIT_GRACE_S = 30.0  # how long a run may take to exit once its report is complete
HEALTH_PROBE = '"GET /health HTTP/1.1" 200'  # uvicorn's access log line
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}


@dataclass
class GuideLLMRun:
    """One ``guidellm run`` against one request format, in a folder of its own."""

    request_format: str
    folder: Path
    attempt: int = 1
    process: subprocess.Popen | None = None
    hung_at_exit: bool = False  # killed after writing a complete report (``wait``)

    @property
    def user(self) -> str:
        """The ``user`` its requests carry, which loramux stores on their usage records."""
        return f"guidellm{self.request_format.replace('/', '-')}-{self.attempt}"

    def start(self, serve: ServeProcess, key: str, tokenizer_dir: Path) -> None:
        options = {
            "--backend": {
                "kind": "openai_http",
                "target": serve.url,
                "model": ADAPTER,
                "api_key": key,
                "request_format": self.request_format,
                "extras": {"body": {"user": self.user}},
            },
            "--profile": {"kind": "concurrent", "streams": [STREAMS]},
            "--data": {
                "kind": "synthetic_text",
                "prompt_tokens": PROMPT_TOKENS,
                "output_tokens": OUTPUT_TOKENS,
            },
            "--constraint": {"kind": "max_requests", "count": REQUESTS},
            "--tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer_dir)},
            "--output": {"kind": "json", "path": str(self.folder / "report.json")},
        }
        command = [sys.executable, "-m", "guidellm", "run", "--disable-console-interactive"]
        for option, config in options.items():
            command += [option, json.dumps(config)]
        # One worker process runs both streams (asyncio): more cost seconds of CPU each.
        env = {**os.environ, **OFFLINE, "GUIDELLM__MAX_WORKER_PROCESSES": "1"}
        # GuideLLM 0.8.1 sets its shutdown event in the callback that receives a request's
        # last update, before queueing that update for the report; its report loop polls
        # the queue with this interval and stops on a timeout once shut down, so a timeout
        # that falls in between drops the last requests from the report (seen in CI on a
        # busy machine: 6 of 8 reported, all 8 served and billed). At 5 s instead of 0.1 s
        # that window is 50 times rarer; the run's end waits one poll (the runs go at once).
        env["GUIDELLM__MP_POLL_INTERVAL"] = "5.0"
        with (self.folder / "guidellm.out").open("wb") as out:
            self.process = subprocess.Popen(
                command,
                cwd=self.folder,  # where it would write guidellm.log
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def wait(self, deadline: float, served: Callable[[str], int]) -> bool:
        """Until it exits, or ``EXIT_GRACE_S`` after its report is complete: GuideLLM 0.8.1
        can hang at its own shutdown after writing the report (seen in CI on a loaded
        machine: the report complete, a ``resource_tracker`` warning about leaked
        semaphores, then no exit until the test's 600 s deadline killed it). What it
        measured is in the report either way, so such a run is killed and marked, and its
        report is read like any other; an exit with an error is still a failure.

        Returns False when it stalled before any report: ``STALL_S`` after ``served``
        (loramux's count of this run's finished requests) reached ``REQUESTS``."""
        reported_at = all_served_at = None
        served_checked = -math.inf  # the usage export is read every SERVED_POLL_S, not per look
        while self.process.poll() is None and time.monotonic() < deadline:
            now = time.monotonic()
            if reported_at is None and self.report_complete():
                reported_at = now
            if reported_at is not None and now - reported_at > EXIT_GRACE_S:
                self.hung_at_exit = True
                break
            if (
                reported_at is None
                and all_served_at is None
                and now - served_checked >= SERVED_POLL_S
            ):
                served_checked = now
                if served(self.user) >= REQUESTS:
                    all_served_at = now
            if reported_at is None and all_served_at is not None and now - all_served_at > STALL_S:
                break
            time.sleep(0.5)
        stalled = self.process.poll() is None and not self.hung_at_exit
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        return not (stalled and all_served_at is not None)

    def report_complete(self) -> bool:
        try:
            report = json.loads((self.folder / "report.json").read_text())
        except (OSError, ValueError):  # not written yet, or half written
            return False
        return bool(report.get("benchmarks"))

    def output(self) -> str:
        return (self.folder / "guidellm.out").read_text(errors="replace")

    def report(self) -> dict:
        """Its JSON report, once it exited 0 (or hung after writing it: ``wait``)."""
        if self.hung_at_exit:
            print(f"GuideLLM {self.request_format} hung after its report; killed")
        else:
            assert self.process.returncode == 0, self.output()[-8000:]
        return json.loads((self.folder / "report.json").read_text())


@dataclass
class Load:
    """What the three runs did: the runs, loramux's usage rows they added (by request id)
    and how many ``GET /health`` probes loramux answered with 200 meanwhile."""

    runs: dict[str, GuideLLMRun]
    usage: dict[str, dict]
    health_probes: int
    stalled_users: list[str]  # of runs GuideLLM stalled in after loramux served them all


def usage_rows(serve: ServeProcess) -> dict[str, dict]:
    """loramux's usage records, one row per request, by request id."""
    response = httpx.get(
        f"{serve.url}/admin/usage", params={"group_by": "request"}, headers=serve.admin
    )
    assert response.status_code == 200, response.text
    return {row["request_id"]: row for row in response.json()["rows"]}


def health_probes(serve: ServeProcess) -> int:
    return serve.log.read_text(errors="replace").count(HEALTH_PROBE)


@pytest.fixture(scope="module")
def load(tmp_path_factory, smollm2_dir, make_adapter) -> Iterator[Load]:
    """``loramux serve`` with the tenant's adapter, and the three GuideLLM runs against it,
    at once, to their end."""
    adapter_dir = make_adapter(smollm2_dir, rank=8, targets=("q_proj", "v_proj"), seed=11)
    root = tmp_path_factory.mktemp("guidellm")
    with serve_with_adapter(root, smollm2_dir, adapter_dir, ADAPTER) as (serve, key):
        before, probes_before = usage_rows(serve), health_probes(serve)
        runs, stalled = {}, []

        def start(request_format: str, attempt: int) -> None:
            folder = root / request_format.strip("/").replace("/", "-") / f"attempt-{attempt}"
            folder.mkdir(parents=True)
            runs[request_format] = run = GuideLLMRun(request_format, folder, attempt)
            run.start(serve, key, smollm2_dir)

        def served(user: str) -> int:
            return sum(row["user"] == user for row in usage_rows(serve).values())

        try:
            for request_format in REQUEST_FORMATS:
                start(request_format, 1)
            deadline = time.monotonic() + RUNS_TIMEOUT_S
            for request_format in REQUEST_FORMATS:
                while not runs[request_format].wait(deadline, served):
                    run = runs[request_format]
                    stalled.append(run.user)
                    print(
                        f"GuideLLM {request_format} (attempt {run.attempt}) stalled "
                        f"{STALL_S:.0f} s after loramux served its {REQUESTS} requests; "
                        f"its last output:\n{run.output()[-2000:]}"
                    )
                    assert run.attempt < ATTEMPTS, "GuideLLM stalled on every attempt"
                    start(request_format, run.attempt + 1)
        finally:
            for run in runs.values():
                if run.process is not None and run.process.poll() is None:
                    run.process.kill()
                    run.process.wait()
        added = {rid: row for rid, row in usage_rows(serve).items() if rid not in before}
        yield Load(runs, added, health_probes(serve) - probes_before, stalled)


def test_guidellm_validates_loramux_on_health_as_it_does_vllm(load):
    # GuideLLM GETs /health (with the key) before it sends a request, and stops on an error.
    assert load.health_probes >= len(REQUEST_FORMATS)
    for run in load.runs.values():
        assert "backend validated" in run.output()


@pytest.mark.parametrize("request_format", REQUEST_FORMATS)
def test_guidellm_finishes_without_error_and_counts_tokens_as_loramux_bills_them(
    load, request_format
):
    run = load.runs[request_format]
    [benchmark] = run.report()["benchmarks"]
    requests = benchmark["requests"]
    assert requests["errored"] == [], [r["info"]["error"] for r in requests["errored"]]
    assert requests["incomplete"] == []
    assert len(requests["successful"]) == REQUESTS
    assert benchmark["metrics"]["request_totals"] == {
        "successful": REQUESTS,
        "errored": 0,
        "incomplete": 0,
        "total": REQUESTS,
    }

    # Request by request, GuideLLM's counts (from the streamed usage) are loramux's records.
    recorded = {rid: row for rid, row in load.usage.items() if row["user"] == run.user}
    measured = {r["response_id"]: r for r in requests["successful"]}
    assert set(measured) == set(recorded)
    for response_id, request in measured.items():
        row = recorded[response_id]
        assert row["adapter"] == ADAPTER
        assert row["finish_reason"] == "length"
        assert request["prompt_tokens"] == row["prompt_tokens"], response_id
        assert request["cached_tokens"] == row["cached_prompt_tokens"], response_id
        assert request["output_tokens"] == row["completion_tokens"] == OUTPUT_TOKENS
        if request_format == "/v1/completions":  # the raw prompt: GuideLLM's own length
            assert row["prompt_tokens"] == PROMPT_TOKENS
        else:  # the same text inside the chat template
            assert row["prompt_tokens"] > PROMPT_TOKENS

    # And the totals GuideLLM reports equal the usage export's.
    metrics = benchmark["metrics"]
    prompt_total = sum(row["prompt_tokens"] for row in recorded.values())
    output_total = sum(row["completion_tokens"] for row in recorded.values())
    assert metrics["prompt_token_count"]["successful"]["total_sum"] == prompt_total
    assert metrics["output_token_count"]["successful"]["total_sum"] == output_total
    print(
        f"GuideLLM {request_format}: {len(measured)} requests, 0 errored, "
        f"{prompt_total} prompt + {output_total} output tokens, equal to loramux's usage"
    )


def test_every_request_loramux_billed_during_the_load_is_one_guidellm_counted(load):
    counted = set()
    for run in load.runs.values():
        [benchmark] = run.report()["benchmarks"]
        for status in ("successful", "errored", "incomplete"):
            counted |= {r["response_id"] for r in benchmark["requests"][status]}
    # A stalled GuideLLM run reported nothing; loramux served each of its requests once,
    # in full (its count reached REQUESTS before the stall was called).
    for user in load.stalled_users:
        rows = [row for row in load.usage.values() if row["user"] == user]
        assert len(rows) == REQUESTS, rows
        assert all(row["completion_tokens"] == OUTPUT_TOKENS for row in rows), rows
        counted |= {row["request_id"] for row in rows}
    assert set(load.usage) == counted
