"""``loramux bench fairness-slo``: weighted fair share, priority and deadlines under overload.

The platform runs in-process (``serve_platform``; SmolLM2-135M unless ``--model``) with the
preset's 8 slots and a per-tenant queue limit of ``QUEUE_LIMIT``; its tenants are ``w1``,
``w2``, ``w4`` (priority 5, weights 1, 2, 4) and ``priority`` (priority 9). Every request
is a streamed completion of random prompt token ids, greedy, exactly ``max_tokens`` tokens,
with its class's deadline as ``timeout``. Two phases:

* **idle**: the priority tenant alone, ``--idle-probes`` requests one after another
  (after two untimed warm-ups);
* **flood**: each weighted tenant keeps ``--streams`` streams busy (each sends its next
  request as soon as one ends; after a 429 it waits the ``Retry-After``, at most
  ``MAX_BACKOFF_S``; after a 503, ``RETRY_503_S``). After ``--warmup`` seconds the measured
  window of ``--duration`` seconds starts, and with it the priority tenant's probes, one
  every ``--probe-interval`` seconds. At the window's end no stream sends another request
  and the run waits for those under way.

Every token is stamped when its chunk arrives; ``/admin/engine`` is sampled every second,
and ``/metrics`` read at the end to cross-check the shed and expired counts.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from loramux.benchmarks.common.bench_server import Target, open_platform, run_apart, serve_platform
from loramux.benchmarks.common.driver_http import _settle_token_times
from loramux.benchmarks.common.files import (
    add_output_options,
    check_sized,
)
from loramux.benchmarks.common.machine import machine_info
from loramux.benchmarks.common.models import prepare_model
from loramux.benchmarks.common.prompts import Prompts
from loramux.benchmarks.fairness_slo.report import write_results
from loramux.benchmarks.serve.presets import PRESETS

PRESET = PRESETS["fairness-slo"]
QUEUE_LIMIT = 4  # LORAMUX_MAX_QUEUED_REQUESTS_PER_TENANT: past it, 429 queue_full
MAX_BACKOFF_S = 30.0  # a stream's longest wait after a 429 (its Retry-After, at most this)
RETRY_503_S = 2.0  # a stream's wait after a 503


@dataclass(frozen=True)
class SLO:
    """A request meets its SLO when its first token comes within ``ttft_s`` and it ends
    before its deadline, ``timeout_s`` (sent as the request's ``timeout``)."""

    ttft_s: float
    timeout_s: float


# By priority. The weighted tenants' waits differ by design (w1's queued requests wait
# about 4 of its requests' run times, w4's under one): their SLO is loose enough that most
# admitted requests meet it, the priority tenant's tight.
SLOS = {5: SLO(ttft_s=20.0, timeout_s=40.0), 9: SLO(ttft_s=1.0, timeout_s=5.0)}
SIZES = {
    "full": dict(duration=90.0, warmup=10.0, streams=6, idle_probes=10, probe_interval=2.0)
    | dict(bucket=5.0, output_tokens=PRESET.workload.output_len[0]),
    # 9 streams on 8 slots, short requests: every tenant gets served within seconds.
    "smoke": dict(
        duration=5.0,
        warmup=1.0,
        streams=3,
        idle_probes=2,
        probe_interval=0.5,
        bucket=1.0,
        output_tokens=8,
    ),
}
PROBE_SHAPE = (16, 8)  # the priority tenant's prompt and output tokens


@dataclass
class Record:
    """One request: times in seconds from the flood's start (the idle phase's own start
    for its probes); ``outcome`` is ok, expired, queue_full, deadline_unattainable or
    ``error: ...``."""

    tenant: str
    phase: str  # "idle" or "flood"
    sent_s: float
    token_times_s: list[float] = field(default_factory=list)
    finish_s: float | None = None
    outcome: str = "ok"
    status: int | None = None  # the HTTP status of a refusal


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="seconds, for the test")
    parser.add_argument("--model", type=Path, help="HF-format model folder (default SmolLM2)")
    for name, what in (
        ("duration", "seconds of the measured (backlogged) window"),
        ("warmup", "seconds of flood before the window"),
        ("probe_interval", "seconds between the priority tenant's requests"),
        ("bucket", "seconds per bucket of the share-over-time series"),
    ):
        parser.add_argument("--" + name.replace("_", "-"), type=float, help=what)
    parser.add_argument("--streams", type=int, help="streams each weighted tenant keeps busy")
    parser.add_argument("--idle-probes", type=int, help="priority requests in the idle phase")
    parser.add_argument("--output-tokens", type=int, help="tokens per weighted request")
    add_output_options(parser)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    positive = ("duration", "probe_interval", "bucket", "streams", "idle_probes")
    check_sized(parser, args, SIZES, (*positive, "output_tokens"))


class Client:
    """One tenant's streamed completions, each becoming a :class:`Record`."""

    def __init__(self, url: str, tenant: str, key: str, model: str, slo: SLO, t0: float):
        # Imported here: `loramux bench`'s other presets run where the client is not installed
        # (the GPU machines).
        import openai

        self.tenant, self.model, self.slo, self.t0 = tenant, model, slo, t0
        self.client = openai.OpenAI(
            base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=slo.timeout_s + 60
        )

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def send(self, prompt: list[int], max_tokens: int, phase: str) -> tuple[Record, float]:
        """The request's record, and how long the caller should wait before its next one."""
        import openai

        record, times, usage, backoff = Record(self.tenant, phase, self.now()), [], None, 0.0
        try:
            stream = self.client.completions.create(
                model=self.model,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"min_tokens": max_tokens, "timeout": self.slo.timeout_s},
            )
            with stream:
                for chunk in stream:
                    stamp = self.now()
                    times.extend(stamp for _ in chunk.choices)
                    if chunk.usage is not None:
                        usage = chunk.usage.completion_tokens
        except openai.APIStatusError as exc:
            record.status, record.outcome = exc.status_code, _outcome(exc)
            if exc.status_code == 429:
                retry_after = float(exc.response.headers.get("retry-after") or MAX_BACKOFF_S)
                backoff = min(retry_after, MAX_BACKOFF_S)
            elif exc.status_code == 503:
                backoff = RETRY_503_S
        except openai.APIError as exc:  # an error event in the stream
            record.outcome = _outcome(exc)
        except Exception as exc:
            record.outcome = f"error: {type(exc).__name__}: {exc}"
        record.finish_s = self.now()
        record.token_times_s = _settle_token_times(times, usage)
        return record, backoff


def _outcome(exc) -> str:
    code = getattr(exc, "code", None)
    if code in ("deadline_exceeded", "queue_full", "deadline_unattainable"):
        return "expired" if code == "deadline_exceeded" else code
    return f"error: {getattr(exc, 'status_code', 'stream')} {code}: {exc.message[:200]}"


class Sampler(threading.Thread):
    """``/admin/engine``'s tenant rows every ``interval`` seconds until stopped."""

    def __init__(self, platform, t0: float, interval: float = 1.0):
        super().__init__(daemon=True)
        self.platform, self.t0, self.interval = platform, t0, interval
        self.samples: list[dict] = []
        self.stop = threading.Event()

    def run(self) -> None:
        keys = ("queued_requests", "running_requests", "share")
        with httpx.Client(base_url=self.platform.url, timeout=30) as client:
            while not self.stop.wait(self.interval):
                got = client.get("/admin/engine", headers=self.platform.admin_headers)
                if got.status_code == 200:
                    rows = {
                        row["tenant_name"]: {k: row[k] for k in keys}
                        for row in got.json()["tenants"]
                        if row["tenant_name"]
                    }
                    t_s, load = time.perf_counter() - self.t0, os.getloadavg()[0]
                    self.samples.append({"t_s": t_s, "loadavg_1m": load, "tenants": rows})


def run_phases(args: argparse.Namespace, target: Target) -> dict:
    """The idle phase, then the flood; every record and the engine's samples."""
    prompts = Prompts(target.vocab_size, target.avoid)
    prompt_len, output_len = PRESET.workload.input_len[0], args.output_tokens
    weighted = [name for name, t in target.tenants.items() if t["priority"] == 5]

    def client(name: str, t0: float) -> Client:
        t = target.tenants[name]
        return Client(target.url, name, t["key"], target.model, SLOS[t["priority"]], t0)

    def send_probe(phase: str) -> Record:
        return probe.send(prompts(PROBE_SHAPE[0]), PROBE_SHAPE[1], phase)[0]

    probe = client("priority", time.perf_counter())
    # Warm-ups, untimed: the first steps, and the admission's measured rates.
    warmups = [send_probe("warmup") for _ in "ab"]
    probe.t0 = time.perf_counter()
    idle = [send_probe("idle")]
    while len(idle) < args.idle_probes:
        time.sleep(0.2)
        idle.append(send_probe("idle"))

    t0 = time.perf_counter()
    window = (args.warmup, args.warmup + args.duration)
    records: list[Record] = []
    sampler = Sampler(target, t0)

    def stream(c: Client) -> None:
        while c.now() < window[1]:
            record, backoff = c.send(prompts(prompt_len), output_len, "flood")
            records.append(record)  # list.append is atomic
            time.sleep(backoff)

    def probes() -> None:
        time.sleep(max(0.0, window[0] - probe.now()))
        while (start := probe.now()) < window[1]:
            records.append(send_probe("flood"))
            time.sleep(max(0.0, start + args.probe_interval - probe.now()))

    clients = [client(name, t0) for name in weighted for _ in range(args.streams)]
    probe.t0 = t0
    threads = [threading.Thread(target=stream, args=(c,), daemon=True) for c in clients]
    threads.append(threading.Thread(target=probes, daemon=True))
    sampler.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sampler.stop.set()
    sampler.join()
    for c in [*clients, probe]:
        c.client.close()
    return {
        "window_s": window,
        "warmup": [asdict(r) for r in warmups],
        "idle": [asdict(r) for r in idle],
        "flood": [asdict(r) for r in records],
        "engine_samples": sampler.samples,
    }


def read_metrics(platform, tenants: dict) -> dict:
    """``/metrics``' shed, expired and served-token counters per tenant name."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {t["id"]: name for name, t in tenants.items()}
    text = httpx.get(f"{platform.url}/metrics", headers=platform.admin_headers, timeout=30).text
    wanted = {
        "loramux_requests_shed": "reason",
        "loramux_requests_expired": "state",
        "loramux_tenant_served_tokens": "kind",
    }
    counts: dict = {name: {} for name in wanted}
    for family in text_string_to_metric_families(text):
        if family.name not in wanted:
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total") or sample.labels.get("tenant") not in names:
                continue
            per = counts[family.name].setdefault(names[sample.labels["tenant"]], {})
            per[sample.labels[wanted[family.name]]] = int(sample.value)
    return counts


def run(args: argparse.Namespace) -> int:
    model_dir = args.model if args.model is not None else prepare_model(args.cache_dir)
    settings = {**PRESET.engine, "max_queued_requests_per_tenant": QUEUE_LIMIT}
    load_before = os.getloadavg()
    with serve_platform(model_dir, **settings) as platform:
        specs = [
            dict(name=t.name, priority=t.priority, weight=t.weight) for t in PRESET.workload.tenants
        ]
        target = open_platform(platform, specs)
        tenants = target.tenants
        raw = run_apart(run_phases, args, target)
        raw["metrics"] = read_metrics(platform, tenants)
    report = {
        "preset": PRESET.name,
        "description": PRESET.description,
        "command": args.command_line,
        "model": model_dir.name,
        "machine": machine_info(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "settings": settings,
        "config": {k: getattr(args, k) for k in ("smoke", *SIZES["full"])}
        | {"prompt_tokens": PRESET.workload.input_len[0]}
        | {"probe_prompt_tokens": PROBE_SHAPE[0], "probe_output_tokens": PROBE_SHAPE[1]},
        "tenants": {n: {k: t[k] for k in ("priority", "weight")} for n, t in tenants.items()},
        "slo": {str(p): asdict(s) for p, s in SLOS.items()},
    }
    stem = args.out / f"bench_{PRESET.name}{'-smoke' if args.smoke else ''}"
    write_results(stem, report, raw, SLOS, PRESET.goals)
    return 0
