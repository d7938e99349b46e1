"""A bounded soak: a real ``loramux serve`` under steady load with adapter churn.

One ``loramux serve`` subprocess on the embedded default (SQLite, local store, the engine
in-process, SmolLM2-135M unless ``--model`` names another HF folder) in a fresh data dir,
with its own ``TMPDIR``. Three tenants (different priorities, weights and prices; one with
a monthly budget and rate limits, so budget holds and limiter reservations are taken and
released all the time) each get an API key and two stable adapters (never deleted). Then,
for ``--duration`` seconds:

* **steady load**: ``--concurrency`` clients, each paced to an equal share of ``--rate``
  requests/s (one that falls behind sends its next request at once, never a burst):
  completions and chat, plain and streamed (``include_usage``), some dropped by the
  client after a few chunks, some with ``max_tokens`` 1 or 2, over the base model, the
  stable adapters and the churned ones, half of the latter the freshest (cold loads);
* **adapter churn**: every ``--churn-interval`` seconds one tenant in turn uploads a new
  adapter, a new version of a stable or a churned one, or deletes its oldest churned one
  (at most four live; names are reused), so the engine registers, loads, evicts and
  unloads adapters all along. The uploads are random PEFT adapters (ranks 4/8/16; q/v,
  q/k/v/o or all seven projections) written once into the cache; the store is
  content-addressed, so the data dir grows only by the database's rows;
* **sampling** every ``--sample-interval`` seconds: the server's RSS, peak RSS, threads,
  open fds and CPU time (``/proc``), the data dir and ``TMPDIR``, ``/admin/engine``
  (running and waiting requests, KV blocks, adapters per tier) and ``/metrics`` (adapter
  loads and evictions, preemptions, failed steps, HTTP 5xx).

The soak fails on any 5xx, transport error or error event in a stream, on a 4xx other
than a 404 for an adapter the churn deleted while the request was under way, and when
billing differs from what the API returned: ``/admin/usage?group_by=request`` must hold,
for every request, exactly the ``usage`` it returned (streams: the final
``include_usage`` chunk) and, for a dropped stream, the tokens the client received
(counted from the chunks' logprobs, reading to the end of what the server sent after the
client half-closed), and nothing else (a request that delivered no token has no row, as
documented). After the load the server gets SIGTERM and must shut down gracefully; then
no adapter version may be left ``uploading`` or ``validating``, no usage row
provisional, nothing in ``tmp/uploads`` or the server's ``TMPDIR``. The engine may hold
registered at most the latest version of every adapter that can be live, one per client
(a request still on an older version) and those superseded within the platform's grace
period: more is versions no request can reach, growing with the uploads.

**Memory.** The first ``--warmup`` of the run is excluded: the model's first steps, the
allocator's arenas and the adapter tiers filling up. The host-RAM adapter tier is LRU and
byte-bounded; the soak sets it to ``--adapter-host-bytes`` (about six of these 1-9 MB
adapters) rather than the 1 GiB default, which the churn would take the whole run to
fill, so the bound is reached in the warm-up. On the CPU the device tier lives inside the
KV cache's budget (allocated at start), so it cannot grow either. Over the rest a
least-squares line is fitted to RSS; "no growth" is its rise staying within
``--rss-tolerance-mib`` (32 MiB, 4 MiB/min over eight minutes): glibc's arenas and their
fragmentation, allocations of sizes first met late (new batch and prompt shapes) and the
database's page caches move RSS by tens of MiB without a leak. The slope over the second
half is reported too: a leak keeps its slope, a cache filling up flattens. fds and
threads get the same fit with 8 of slack (connections and files open at a sample; thread
pools grow on demand). The soak is about growth and errors, not speed: on a shared
machine latency and throughput are whatever the neighbours left.

    loramux bench soak           # 10 minutes on SmolLM2: benchmarks/results/soak_cpu.*
    loramux bench soak --duration 10 --model DIR --out DIR   # a smoke
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from loramux.benchmarks.common.adapters import AdapterSpec
from loramux.benchmarks.common.files import (
    CHECKOUT,
    add_output_options,
    check_output_options,
    write_report,
)
from loramux.benchmarks.common.machine import machine_info
from loramux.benchmarks.common.models import prepare_model
from loramux.benchmarks.soak_load import KINDS, MAX_CHURNED, TARGETS, run_load
from loramux.benchmarks.soak_report import render_markdown, write_plot
from loramux.benchmarks.soak_server import MIB, start_server
from loramux.benchmarks.soak_tenants import STABLE_ADAPTERS, TENANTS, prepare_pool
from loramux.benchmarks.soak_verdict import check_after_load, classify, judge, rate_bins

OPTIONS = (  # flag, type, default, help
    ("--duration", float, 600.0, "seconds of load"),
    ("--concurrency", int, 6, "clients sending at once"),
    ("--rate", float, 1.5, "requests/s offered, in all"),
    ("--churn-interval", float, 3.0, "seconds between adapter churn acts"),
    ("--sample-interval", float, 10.0, "seconds between samples"),
    ("--warmup", float, 0.2, "fraction of the run left out of the fit"),
    ("--rss-tolerance-mib", float, 32.0, "fitted RSS rise over the steady part that is no growth"),
    ("--adapter-host-bytes", int, 32 * MIB, "LORAMUX_ADAPTER_HOST_BYTES of the server"),
    ("--model", Path, None, "HF-format model folder (default SmolLM2)"),
    ("--seed", int, 0, "seed of the clients and churn"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="loramux bench soak", description=__doc__.split("\n\n")[0]
    )
    for flag, kind, default, text in OPTIONS:
        parser.add_argument(flag, type=kind, default=default, help=text)
    add_output_options(parser)
    args = parser.parse_args(argv)
    check_output_options(parser, args)
    if min(args.duration, args.rate, args.churn_interval, args.sample_interval) <= 0:
        parser.error("--duration, --rate, --churn-interval and --sample-interval must be > 0")
    if args.concurrency < 1 or not 0 <= args.warmup < 1:
        parser.error("--concurrency must be >= 1 and --warmup in [0, 1)")
    return args


def run_soak(args, model_dir: Path, pool: list[AdapterSpec], root: Path) -> dict:
    code = code_version()  # what the server is started from
    with start_server(args, model_dir, root) as server:
        print(f"loramux serve ready in {server.started_s:.1f} s at {server.url}", flush=True)
        ledger, sampler = run_load(args, server, pool)
        checked = check_after_load(server, ledger)
    counts = classify(ledger)
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
        "server_start_s": round(server.started_s, 2),
        "samples": sampler.samples,
        "sample_errors": sampler.errors,
        "churn_events": [asdict(e) for e in ledger.events],
        "rate_bins": rate_bins(ledger, args.sample_interval),
        "counts": counts,
        **checked,
        "verdict": judge(args, sampler.samples, counts, checked),
    }


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    model_dir = args.model if args.model is not None else prepare_model(args.cache_dir)
    pool = prepare_pool(model_dir, args.cache_dir)
    with tempfile.TemporaryDirectory(prefix="loramux-soak-") as root:
        report = run_soak(args, model_dir, pool, Path(root))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"soak_{'cuda' if torch.cuda.is_available() else 'cpu'}"
    write_plot(report, stem.with_suffix(".png"))
    write_report(stem, report, render_markdown(report, stem.with_suffix(".png").name))
    return 0 if report["verdict"]["passed"] else 1


def code_version() -> dict:
    """The commit the server ran and how many files of the working tree differed from it
    (other work in progress is served too); an installed loramux has no commit to name."""
    if CHECKOUT is None:
        return {"commit": "none (installed package)", "changed_files": 0}

    git = functools.partial(subprocess.run, cwd=CHECKOUT, capture_output=True, text=True)
    return {
        "commit": git(["git", "rev-parse", "--short", "HEAD"]).stdout.strip(),
        "changed_files": len(git(["git", "status", "--porcelain"]).stdout.splitlines()),
    }


if __name__ == "__main__":
    sys.exit(main())
