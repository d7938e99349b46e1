"""A bounded soak: a real ``loramux serve`` under steady load with adapter churn.

One ``loramux serve`` subprocess on the embedded default (SQLite, local store, the engine
in-process, SmolLM2-135M unless ``--model`` names another HF folder) in a fresh data dir
under a temporary folder, with its own ``TMPDIR`` there. Three tenants (different
priorities, weights and prices; one with a monthly budget and rate limits, so budget holds
and limiter reservations are taken and released all the time) each get an API key and
two stable adapters (never deleted). Then, for ``--duration`` seconds (default 600):

* **steady load**: ``--concurrency`` clients (default 6), each paced to an equal share of
  ``--rate`` requests/s (a client that falls behind sends its next request at once, never
  a burst): completions and chat, non-streamed and streamed (``include_usage``), some
  dropped by the client after a few chunks, some with ``max_tokens`` 1 or 2, over the base
  model, the stable adapters and the churned ones, half of the latter the freshest
  (cold loads);
* **adapter churn**: every ``--churn-interval`` seconds (default 3) one tenant in turn
  uploads a new adapter, uploads a new version of a stable or a churned one, or deletes
  its oldest churned adapter (at most four live; names are reused after a delete), so the
  engine registers, loads, evicts and unloads adapters all along.
  The uploads are random PEFT adapters (``adapters``: ranks 4/8/16; q/v, q/k/v/o or all
  seven projections), written once into the cache; the
  store is content-addressed, so re-uploading them adds no objects and the store stays
  flat: the data dir grows only by the database's rows;
* **sampling** every ``--sample-interval`` seconds (default 10): the server's RSS, peak
  RSS, threads and open fds (``/proc``), its CPU time, the data dir (database, store,
  ``tmp/uploads``) and its ``TMPDIR``, ``/admin/engine`` (running and waiting requests, KV
  blocks, adapters per tier) and ``/metrics`` (adapter loads and evictions, preemptions,
  failed steps, HTTP 5xx).

Every response is counted by status. The soak fails on any 5xx, transport error or
error event in a stream, on a 4xx other than a 404 for an adapter the churn deleted while
the request was under way, and when billing differs from what the API returned:
``/admin/usage?group_by=request`` must hold, for every request, exactly the ``usage`` it
returned (streams: the final ``include_usage`` chunk) and, for a dropped stream, the
tokens the client received (counted from the chunks' logprobs, reading to the end of
what the server sent after the client half-closed), and nothing else (a request that
delivered no token has no row, as documented). After the load the server gets SIGTERM
and must shut down gracefully; then the database is read: no adapter version may be
left ``uploading`` or ``validating`` and no usage row provisional, and nothing may be left
in ``tmp/uploads`` or the server's ``TMPDIR``. The engine may hold at most the latest
version of every adapter that can be live plus one per client (a request still on an
older version) registered: more is versions no request can reach, growing with uploads.

**Memory.** The first ``--warmup`` (20 %) of the run is excluded: the model's first
steps, the allocator's arenas and the adapter tiers filling up. The host-RAM adapter
tier is LRU and byte-bounded (``LORAMUX_ADAPTER_HOST_BYTES``); the soak sets it to
``--adapter-host-bytes`` (32 MiB, about six of these adapters, which are 1-9 MB in
float32) rather than the 1 GiB default, which the churn would take the whole run to fill,
so the bound is reached in the warm-up and growth after it is not that cache. On the CPU
the device tier lives inside the KV cache's budget (``LORAMUX_KV_CACHE_BYTES``, 256 MiB,
allocated at start), so it cannot grow either. Over the rest a least-squares line is
fitted to RSS; the verdict is "no growth" when its rise over the steady part stays
within ``--rss-tolerance-mib`` (32 MiB, 4 MiB/min over eight minutes): glibc's arenas
(one per thread that allocates, up to 8 per core) and their fragmentation, allocations of
sizes first met late (new batch and prompt shapes) and the database's page caches move
RSS by tens of MiB without a leak. The slope over the second half is reported too: a
leak keeps its slope, a cache filling up flattens. fds and threads get the same fit with
8 of slack (connections and files open at a sample; thread pools grow on demand).

The soak is about growth and errors, not speed: on a shared 2-core machine the figures
for latency and throughput are whatever the neighbours left.

    loramux bench soak           # 10 minutes on SmolLM2: benchmarks/results/soak_cpu.*
    loramux bench soak --duration 10 --model DIR --out DIR   # a smoke

Modules, one part of the soak each:

* ``soak.py``: the options, the run (server up, tenants, load, checks, verdict) and the
  report's files;
* ``soak_server.py``: the ``loramux serve`` subprocess, its start, SIGTERM and log;
* ``soak_tenants.py``: the tenants, the adapter pool, the stable adapters, the catalog of
  live names;
* ``soak_ledger.py`` and ``soak_worker.py``: what the load's threads record, and those
  threads' base;
* ``soak_clients.py``: the request kinds and the paced clients;
* ``soak_churn.py``: the adapter churn;
* ``soak_sampling.py``: the samples of the server, its disk, its engine and metrics;
* ``soak_checks.py``: billing, the database and leftovers after the load;
* ``soak_verdict.py``: responses by status, the fits, the registration bound, the checks;
* ``soak_report.py`` and ``soak_plot.py``: the markdown and the PNG.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from loramux.benchmarks.adapters import AdapterSpec
from loramux.benchmarks.files import (
    CHECKOUT,
    add_output_options,
    check_output_options,
    write_report,
)
from loramux.benchmarks.machine import machine_info
from loramux.benchmarks.models import prepare_model
from loramux.benchmarks.soak_checks import check_billing, leftovers, read_database
from loramux.benchmarks.soak_churn import MAX_CHURNED, Churner
from loramux.benchmarks.soak_clients import KINDS, TARGETS, LoadClient
from loramux.benchmarks.soak_ledger import Ledger
from loramux.benchmarks.soak_plot import write_plot
from loramux.benchmarks.soak_report import render_markdown
from loramux.benchmarks.soak_sampling import MIB, Sampler
from loramux.benchmarks.soak_server import Server, log_errors, start_server, stop_server
from loramux.benchmarks.soak_tenants import (
    STABLE_ADAPTERS,
    TENANTS,
    Catalog,
    base_model_id,
    create_tenants,
    prepare_pool,
    upload_stable,
)
from loramux.benchmarks.soak_verdict import classify, judge, rate_bins
from loramux.benchmarks.soak_worker import join_all


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="loramux bench soak", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=6, help="clients sending at once")
    parser.add_argument("--rate", type=float, default=1.5, help="requests/s offered, in all")
    parser.add_argument(
        "--churn-interval", type=float, default=3.0, help="seconds between adapter churn acts"
    )
    parser.add_argument(
        "--sample-interval", type=float, default=10.0, help="seconds between samples"
    )
    parser.add_argument(
        "--warmup", type=float, default=0.2, help="fraction of the run left out of the fit"
    )
    parser.add_argument(
        "--rss-tolerance-mib",
        type=float,
        default=32.0,
        help="RSS may rise this much over the steady part (fitted) and still be no growth",
    )
    parser.add_argument(
        "--adapter-host-bytes",
        type=int,
        default=32 * MIB,
        help="LORAMUX_ADAPTER_HOST_BYTES of the server (the host tier's bound)",
    )
    parser.add_argument("--model", type=Path, help="HF-format model folder (default SmolLM2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the clients and churn")
    add_output_options(parser)
    args = parser.parse_args(argv)
    check_output_options(parser, args)
    if min(args.duration, args.rate, args.churn_interval, args.sample_interval) <= 0:
        parser.error("--duration, --rate, --churn-interval and --sample-interval must be > 0")
    if args.concurrency < 1 or not 0 <= args.warmup < 1:
        parser.error("--concurrency must be >= 1 and --warmup in [0, 1)")
    return args


def resolve_model(args: argparse.Namespace) -> Path:
    return args.model if args.model is not None else prepare_model(args.cache_dir)


def run_load(args, server: Server, catalog: Catalog, pool: list[AdapterSpec]) -> tuple:
    """The clients, the churn and the sampler for ``args.duration`` seconds."""
    ledger, stop, sampling = Ledger(time.monotonic()), threading.Event(), threading.Event()
    sampler = Sampler(server, ledger, args.sample_interval, sampling)
    workers = [LoadClient(i, server, catalog, ledger, args, stop) for i in range(args.concurrency)]
    workers.append(Churner(server, catalog, ledger, pool, args, stop))
    for thread in (sampler, *workers):
        thread.start()
    stop.wait(args.duration)
    stop.set()
    join_all(workers)  # requests under way finish; nothing new starts
    sampling.set()
    join_all([sampler])
    with httpx.Client(base_url=server.url, timeout=60) as client:
        sampler.take(client)  # after the load: everything idle again
    return ledger, sampler


def run_soak(args, model_dir: Path, pool: list[AdapterSpec], root: Path) -> dict:
    code = code_version()  # what the server is started from
    with start_server(args, model_dir, root) as server:
        print(f"loramux serve ready in {server.started_s:.1f} s at {server.url}", flush=True)
        tenants = create_tenants(server)
        catalog = Catalog(tenants, base_model_id(server))
        upload_stable(server, tenants, pool)
        print(f"load: {args.duration:.0f} s, {args.concurrency} clients, {args.rate}/s", flush=True)
        ledger, sampler = run_load(args, server, catalog, pool)
        billing = check_billing(server, ledger)
        shutdown = stop_server(server)
        ending = {"shutdown": shutdown, "leftovers": leftovers(server)}
        errors, log_tail = log_errors(server), server.public_log_tail()
        db = read_database(server.data_dir)
        started_s = server.started_s
    counts = classify(ledger)
    verdict = judge(args, sampler.samples, counts, billing, db, ending)
    return {
        "benchmark": "soak",
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "model": str(model_dir),
            "tenants": TENANTS,
            "stable_adapters_per_tenant": STABLE_ADAPTERS,
            "max_churned_per_tenant": MAX_CHURNED,
            "pool": [{"rank": a.rank, "targets": list(a.targets)} for a in pool],
            "kinds": {k.name: k.weight for k in KINDS},
            "targets": TARGETS,
        },
        "machine": machine_info(),
        "code": code,
        "server_start_s": round(started_s, 2),
        "samples": sampler.samples,
        "sample_errors": sampler.errors,
        "churn_events": [asdict(e) for e in ledger.events],
        "rate_bins": rate_bins(ledger, args.sample_interval),
        "counts": counts,
        "billing": billing,
        "database": db,
        "ending": ending,
        "server_log_errors": errors[:50],
        "server_log_tail": log_tail,
        "verdict": verdict,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = resolve_model(args)
    pool = prepare_pool(model_dir, args.cache_dir)
    with tempfile.TemporaryDirectory(prefix="loramux-soak-") as root:
        report = run_soak(args, model_dir, pool, Path(root))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"soak_{device_name()}"
    write_plot(report, stem.with_suffix(".png"))
    write_report(stem, report, render_markdown(report, stem.with_suffix(".png").name))
    return 0 if report["verdict"]["passed"] else 1


def code_version() -> dict:
    """The commit the server ran and how many files of the working tree differed from it
    (other work in progress is served too); an installed loramux has no commit to name."""
    if CHECKOUT is None:
        return {"commit": "none (installed package)", "changed_files": 0}

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=CHECKOUT, capture_output=True, text=True)
        return done.stdout.strip()

    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "changed_files": len(git("status", "--porcelain").splitlines()),
    }


def device_name() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    sys.exit(main())
