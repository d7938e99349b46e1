"""``loramux bench fairness-slo``: weighted fair share, priority and deadlines under overload.

The platform runs in-process on the embedded default (``bench_server.serve_platform``:
SQLite, local store, the engine in-process; SmolLM2-135M unless ``--model``) with the
preset's 8 slots and a per-tenant queue limit of ``QUEUE_LIMIT``. Four tenants
(``bench_presets``' ``fairness-slo``): ``w1``, ``w2``, ``w4`` at priority 5 with weights 1,
2 and 4, and ``priority`` at priority 9. Every request is a streamed completion on the
base model sent with the ``openai`` client (``max_retries=0``), random prompt token ids,
greedy, exactly ``max_tokens`` tokens (``min_tokens``), and carries its class's deadline
as ``timeout`` in ``extra_body``. Two phases:

* **idle**: the priority tenant alone, ``--idle-probes`` requests one after another
  (after two untimed warm-ups): its idle time to first token;
* **flood**: each weighted tenant keeps ``--streams`` streams busy (18 on 8 slots: each
  stream sends its next request as soon as one ends; after a 429 it waits the
  ``Retry-After``, at most ``MAX_BACKOFF_S``; after a 503, ``RETRY_503_S``). After
  ``--warmup`` seconds the measured window of ``--duration`` seconds starts, and with it
  the priority tenant's probes, one every ``--probe-interval`` seconds. At the window's
  end no stream sends another request and the run waits for those under way.

The clients run in a process of their own (spawned), so the server's engine loop and
event loop never share an interpreter lock with 19 streaming clients.

Every token is stamped when its chunk arrives. ``/admin/engine`` is sampled every second
(queued and running requests per tenant, the engine's own share), and ``/metrics`` read at
the end to cross-check the shed and expired counts. ``fairness_slo_report`` turns the
records into figures, plots and the report: ``<out>/bench_fairness-slo.{json,md}`` and
``bench_fairness-slo_{share,ttft_cdf}.png`` (``-smoke`` in the names with ``--smoke``).

    loramux bench fairness-slo                     # 90-s window on SmolLM2
    loramux bench fairness-slo --smoke --model DIR --out DIR   # seconds, for the test
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from loramux.benchmarks.bench_presets import PRESETS
from loramux.benchmarks.common.driver_http import _settle_token_times
from loramux.benchmarks.common.files import (
    add_output_options,
    check_output_options,
    fill_sizes,
    write_report,
)
from loramux.benchmarks.common.machine import Clock, machine_info
from loramux.benchmarks.common.models import prepare_model
from loramux.benchmarks.fairness_slo_report import (
    compact,
    render_markdown,
    summarize,
    write_plots,
)

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
FULL = dict(duration=90.0, warmup=10.0, streams=6, idle_probes=10, probe_interval=2.0)
SIZES = {
    "full": FULL | dict(bucket=5.0, output_tokens=PRESET.workload.output_len[0]),
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

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.sent_s if self.token_times_s else None


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="loramux bench fairness-slo", description=__doc__.split("\n\n")[0]
    )
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
    args = parser.parse_args(argv)
    check_output_options(parser, args)
    fill_sizes(args, SIZES)
    sizes = (args.duration, args.probe_interval, args.bucket, args.streams, args.idle_probes)
    if min(*sizes, args.output_tokens) <= 0:
        parser.error("durations, intervals and counts must be positive")
    args.command = " ".join(["loramux bench fairness-slo", *argv])
    return args


class Prompts:
    """Random prompt token ids (EOS avoided), a fresh prompt per request."""

    def __init__(self, model_dir: Path, seed: int = 0):
        from loramux.engine.model.config import ModelConfig

        config = ModelConfig.from_pretrained(model_dir)
        avoid = set(config.eos_token_ids)
        self._ids = np.array([i for i in range(3, config.vocab_size) if i not in avoid])
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()

    def __call__(self, length: int) -> list[int]:
        with self._lock:
            return self._rng.choice(self._ids, size=length).tolist()


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

    def close(self) -> None:
        self.client.close()


def _outcome(exc) -> str:
    code = getattr(exc, "code", None)
    if code in ("deadline_exceeded", "queue_full", "deadline_unattainable"):
        return "expired" if code == "deadline_exceeded" else code
    return f"error: {getattr(exc, 'status_code', 'stream')} {code}: {exc.message[:200]}"


def create_tenants(platform) -> dict[str, dict]:
    """The preset's tenants, each with an API key: name -> {id, key, priority, weight}."""

    tenants = {}
    with httpx.Client(base_url=platform.url, headers=platform.admin_headers, timeout=60) as c:
        for spec in PRESET.workload.tenants:
            body = {"name": spec.name, "priority": spec.priority, "weight": spec.weight}
            made = c.post("/admin/tenants", json=body)
            made.raise_for_status()
            key = c.post(f"/admin/tenants/{made.json()['id']}/api-keys")
            key.raise_for_status()
            tenants[spec.name] = {"id": made.json()["id"], "key": key.json()["key"], **body}
    return tenants


class Sampler(threading.Thread):
    """``/admin/engine``'s tenant rows every ``interval`` seconds until stopped."""

    def __init__(self, platform, t0: float, interval: float = 1.0):
        super().__init__(daemon=True)
        self.platform, self.t0, self.interval = platform, t0, interval
        self.samples: list[dict] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.platform.url, timeout=30) as client:
            while not self.stop.wait(self.interval):
                got = client.get("/admin/engine", headers=self.platform.admin_headers)
                if got.status_code == 200:
                    rows = {
                        row["tenant_name"]: {
                            k: row[k] for k in ("queued_requests", "running_requests", "share")
                        }
                        for row in got.json()["tenants"]
                        if row["tenant_name"]
                    }
                    t_s, load = time.perf_counter() - self.t0, os.getloadavg()[0]
                    self.samples.append({"t_s": t_s, "loadavg_1m": load, "tenants": rows})


@dataclass(frozen=True)
class Target:
    """The running platform, as the client process needs it."""

    url: str
    admin_headers: dict[str, str]
    base_model: str


def run_phases(args: argparse.Namespace, platform: Target, tenants: dict, model_dir: Path) -> dict:
    """The idle phase, then the flood; every record and the engine's samples. It runs in a
    process of its own, so the clients' threads never wait on the server's interpreter."""
    prompts = Prompts(model_dir)
    model = platform.base_model
    spec = PRESET.workload
    prompt_len, output_len = spec.input_len[0], args.output_tokens
    weighted = [t for t in tenants if tenants[t]["priority"] == 5]

    def client(name: str, t0: float) -> Client:
        t = tenants[name]
        return Client(platform.url, name, t["key"], model, SLOS[t["priority"]], t0)

    probe = client("priority", time.perf_counter())
    # Warm-ups, untimed: the first steps, and the admission's measured rates.
    warmups = [probe.send(prompts(PROBE_SHAPE[0]), PROBE_SHAPE[1], "warmup")[0] for _ in "ab"]
    probe.t0 = time.perf_counter()
    idle = [probe.send(prompts(PROBE_SHAPE[0]), PROBE_SHAPE[1], "idle")[0]]
    while len(idle) < args.idle_probes:
        time.sleep(0.2)
        idle.append(probe.send(prompts(PROBE_SHAPE[0]), PROBE_SHAPE[1], "idle")[0])

    t0 = time.perf_counter()
    window = (args.warmup, args.warmup + args.duration)
    records: list[Record] = []
    lock = threading.Lock()
    sampler = Sampler(platform, t0)

    def stream(c: Client) -> None:
        while c.now() < window[1]:
            record, backoff = c.send(prompts(prompt_len), output_len, "flood")
            with lock:
                records.append(record)
            time.sleep(backoff)

    def probes(c: Client) -> None:
        time.sleep(max(0.0, window[0] - c.now()))
        while (start := c.now()) < window[1]:
            record, _ = c.send(prompts(PROBE_SHAPE[0]), PROBE_SHAPE[1], "flood")
            with lock:
                records.append(record)
            time.sleep(max(0.0, start + args.probe_interval - c.now()))

    clients = [client(name, t0) for name in weighted for _ in range(args.streams)]
    probe.t0 = t0
    threads = [threading.Thread(target=stream, args=(c,), daemon=True) for c in clients]
    threads.append(threading.Thread(target=probes, args=(probe,), daemon=True))
    sampler.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sampler.stop.set()
    sampler.join()
    for c in [*clients, probe]:
        c.close()
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


def main(argv: list[str] | None = None) -> int:
    from loramux.benchmarks.common.bench_server import serve_platform

    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    model_dir = args.model if args.model is not None else prepare_model(args.cache_dir)
    settings = {**PRESET.engine, "max_queued_requests_per_tenant": QUEUE_LIMIT}
    load_before = os.getloadavg()
    with serve_platform(model_dir, **settings) as platform:
        tenants = create_tenants(platform)
        target = Target(platform.url, platform.admin_headers, platform.base_model)
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as clients, Clock() as clock:
            run = clients.submit(run_phases, args, target, tenants, model_dir).result()
        # This process is the server: its CPU over both phases, against the machine's load.
        run["clock"] = {"seconds": round(clock.seconds, 1), **clock.summary()}
        run["metrics"] = read_metrics(platform, tenants)
    report = {
        "preset": PRESET.name,
        "description": PRESET.description,
        "command": args.command,
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
        **summarize(run, tenants, SLOS, args.bucket, PRESET.goals),
        "raw": compact(run),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"bench_{PRESET.name}{'-smoke' if args.smoke else ''}"
    plots = write_plots(report, stem)
    write_report(stem, report, render_markdown(report, plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
