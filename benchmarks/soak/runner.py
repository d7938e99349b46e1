"""A bounded soak: a real ``loramux serve`` under steady load with adapter churn.

One ``loramux serve`` subprocess on the embedded default (SmolLM2-135M unless ``--model``
names another HF folder) in a fresh data dir, with its own ``TMPDIR``. Three tenants
(different priorities, weights and prices; one with a budget and rate limits, so budget
holds and limiter reservations are taken and released all the time) each get an API key
and two stable adapters. Then, for ``--duration`` seconds, ``--concurrency`` clients each
send an equal share of ``--rate`` requests/s (one that falls behind sends its next at
once, never a burst): completions and chat, plain and streamed, some dropped by the
client after a few chunks, some of 1 or 2 tokens, over the base model, the stable
adapters and the churned ones, half of the latter the freshest (cold loads). Every
``--churn-interval`` seconds one tenant in turn uploads a new adapter, a new version of
one, or deletes its oldest churned one, so the engine registers, loads, evicts and
unloads adapters all along (the store is content-addressed and the uploads come from a
small pool, so the data dir grows only by the database's rows). The server is sampled
every ``--sample-interval`` seconds (``server.take_sample``).

The soak fails (``verdict.judge``) on any 5xx, transport error or error event in a
stream, on a 4xx other than a 404 for an adapter the churn deleted while the request was
under way, when ``/admin/usage?group_by=request`` does not hold, for every request,
exactly what the client got (its ``usage``; for a dropped stream, the tokens that reached
it) and nothing else, when the engine holds registered more versions than requests can
reach, and when after SIGTERM the server did not shut down gracefully or left an adapter
version ``uploading`` or ``validating``, a provisional usage row, or files behind.

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
threads get the same fit with 8 of slack. The soak is about growth and errors, not speed.

    loramux bench soak           # 10 minutes on SmolLM2: benchmarks/results/soak_cpu.*
    loramux bench soak --duration 10 --model DIR --out DIR   # a smoke
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import tempfile
from dataclasses import asdict
from pathlib import Path

from loramux.benchmarks.common.files import CHECKOUT, add_output_options, check_output_options
from loramux.benchmarks.common.machine import machine_info
from loramux.benchmarks.common.models import prepare_model
from loramux.benchmarks.common.report import write
from loramux.benchmarks.common.serve_process import serve
from loramux.benchmarks.soak import load
from loramux.benchmarks.soak.report import render_markdown, write_plot
from loramux.benchmarks.soak.server import MIB, stop_and_inspect
from loramux.benchmarks.soak.verdict import check_billing, classify, judge, rate_bins

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


def add_options(parser: argparse.ArgumentParser) -> None:
    for flag, kind, default, text in OPTIONS:
        parser.add_argument(flag, type=kind, default=default, help=text)
    add_output_options(parser)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_output_options(parser, args)
    if min(args.duration, args.rate, args.churn_interval, args.sample_interval) <= 0:
        parser.error("--duration, --rate, --churn-interval and --sample-interval must be > 0")
    if args.concurrency < 1 or not 0 <= args.warmup < 1:
        parser.error("--concurrency must be >= 1 and --warmup in [0, 1)")


def run(args: argparse.Namespace) -> int:
    import torch

    model_dir = args.model if args.model is not None else prepare_model(args.cache_dir)
    pool = load.prepare_pool(model_dir, args.cache_dir)
    code = code_version()  # what the server is started from
    # The embedded default but for the model folder, the host tier's bound and TMPDIR.
    settings = {"model": model_dir, "adapter_host_bytes": args.adapter_host_bytes}
    with (
        tempfile.TemporaryDirectory(prefix="loramux-soak-") as root,
        serve(Path(root), own_tmp=True, **settings) as server,
    ):
        print(f"loramux serve ready in {server.started_s:.1f} s at {server.url}", flush=True)
        ledger, sampler = load.run_load(args, server, pool)
        billing = check_billing(server, ledger)
        ended = stop_and_inspect(server)
    report = {
        "benchmark": "soak",
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "model": str(model_dir),
            "tenants": load.TENANTS,
            "stable_adapters_per_tenant": load.STABLE_ADAPTERS,
            "max_churned_per_tenant": load.MAX_CHURNED,
            "pool": [{"rank": a.rank, "targets": list(a.targets)} for a in pool],
            "kinds": {k.name: k.weight for k in load.KINDS},
            "targets": load.TARGETS,
        },
        "machine": machine_info(),
        "code": code,
        "server_start_s": round(server.started_s, 2),
        "samples": sampler.samples,
        "sample_errors": sampler.errors,
        "churn_events": [asdict(e) for e in ledger.events],
        "rate_bins": rate_bins(ledger, args.sample_interval),
        "counts": classify(ledger),
        "billing": billing,
        **ended,
    }
    report["verdict"] = judge(args, report)
    stem = args.out / f"soak_{'cuda' if torch.cuda.is_available() else 'cpu'}"
    args.out.mkdir(parents=True, exist_ok=True)
    write_plot(report, stem.with_suffix(".png"))
    write(stem, report, render_markdown(report, stem.with_suffix(".png").name))
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
