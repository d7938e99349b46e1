"""The soak's markdown report: the verdict and its checks, requests, churn, memory and
resources, billing, shutdown and what is left.

Part of the soak (``soak.py``).
"""

from __future__ import annotations

from pathlib import Path

from loramux.benchmarks.soak_checks import USAGE_FIELDS
from loramux.benchmarks.soak_sampling import MIB


def _mark(ok: bool) -> str:
    return "ok" if ok else "**FAILED**"


def _fmt(value, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def render_markdown(report: dict, plot_name: str) -> str:
    sections = (
        _md_header(report),
        _md_requests(report),
        _md_churn(report),
        _md_resources(report),
        _md_billing(report),
        _md_ending(report),
        [f"![RSS, responses/s, fds and threads, churn acts over the run]({plot_name})", ""],
    )
    return "\n".join(line for section in sections for line in section)


def _md_header(report: dict) -> list[str]:
    c, m, v = report["config"], report["machine"], report["verdict"]
    loads = [s["load1"] for s in report["samples"]]
    lines = [
        "# Soak: loramux serve under steady load with adapter churn",
        "",
        f"{m['date']}, {m['cpu_model']} ({m['nproc']} cores), {m['mem_total_gib']} GiB; "
        f"commit {report['code']['commit']} (working tree: {report['code']['changed_files']} "
        f"files changed or new); model `{Path(c['model']).name}`; server ready in "
        f"{report['server_start_s']} s. "
        f"{c['duration']:.0f} s of load: {c['concurrency']} clients at {c['rate']} requests/s "
        f"offered, a churn act every {c['churn_interval']} s, a sample every "
        f"{c['sample_interval']} s; host adapter tier bound (`LORAMUX_ADAPTER_HOST_BYTES`) "
        f"{c['adapter_host_bytes'] / MIB:.0f} MiB, everything else the embedded default.",
        "",
        "The soak is about growth and errors, not speed: the machine was shared with other "
        f"work (1-minute load average during the run {min(loads):.1f} to {max(loads):.1f} "
        f"on {m['nproc']} cores), so latencies and throughput are whatever was left.",
        "",
        f"**Verdict: {'passed' if v['passed'] else 'FAILED'}.**",
        "",
        "| check | result |",
        "|---|---|",
    ]
    lines += [f"| {name} | {_mark(ok)} |" for name, ok in v["checks"].items()]
    return [*lines, ""]


def _md_requests(report: dict) -> list[str]:
    counts, c = report["counts"], report["config"]
    statuses = sorted(counts["by_status"])
    lines = [
        "## Requests",
        "",
        f"{counts['requests']} requests in {c['duration']:.0f} s "
        f"({counts['requests'] / c['duration']:.2f}/s achieved); by target: "
        + ", ".join(f"{k} {n}" for k, n in sorted(counts["by_target"].items()))
        + f". 404s for an adapter the churn deleted while the request was under way "
        f"(expected): {counts['expected_404']}; 5xx, transport and stream errors: "
        f"{len(counts['failures'])}; other 4xx: {len(counts['unexpected_4xx'])}.",
        "",
        "| kind | " + " | ".join(statuses) + " |",
        "|---|" + "---|" * len(statuses),
    ]
    for kind, by_status in counts["by_kind"].items():
        lines.append(f"| {kind} | " + " | ".join(str(by_status.get(s, 0)) for s in statuses) + " |")
    lines.append("| **all** | " + " | ".join(str(counts["by_status"][s]) for s in statuses) + " |")
    for o in (counts["failures"] + counts["unexpected_4xx"])[:10]:
        lines.append(
            f"- at {o['picked_s']:.1f} s: {o['kind']} on {o['tenant']}/{o['model']}: "
            f"{o['status']} {o['error']}"
        )
    return [*lines, ""]


def _md_churn(report: dict) -> list[str]:
    samples, v = report["samples"], report["verdict"]
    first, last = samples[0], samples[-1]
    acts = ", ".join(f"{k}: {n}" for k, n in sorted(report["counts"]["churn"].items()))
    tiers = ", ".join(f"{k} {n}" for k, n in sorted(last.get("adapters_by_tier", {}).items()))
    return [
        "## Adapter churn",
        "",
        f"Acts (action status: count): {acts}. Over the run the engine loaded adapters "
        f"{_fmt(last.get('adapter_loads', 0) - first.get('adapter_loads', 0), 0)} times and "
        f"evicted {_fmt(last.get('adapter_evictions', 0) - first.get('adapter_evictions', 0), 0)} "
        f"(both tiers); the host tier held at most "
        f"{_fmt(max(s.get('host_mib', 0) for s in samples))} MiB of its "
        f"{_fmt(last.get('host_capacity_mib'), 0)} MiB bound. Adapter versions registered in "
        f"the engine: at most {v['registered_max']} (bound {v['registered_bound']}: the "
        "latest version of every adapter that can be live, plus one per client for a request "
        "still on an older one, plus those superseded within the platform's grace period), "
        f"{last.get('registered_adapters')} at the end ({tiers}; "
        "`store`: registered, resident nowhere)."
        + (
            " Above the bound, versions no request can reach any more (superseded by a new "
            "version) stay registered in the engine: they grow with the uploads."
            if v["registered_max"] > v["registered_bound"]
            else ""
        ),
        "",
    ]


def _md_resources(report: dict) -> list[str]:
    v, samples = report["verdict"], report["samples"]
    first, last = samples[0], samples[-1]
    lines = [
        f"## Memory and resources (steady part: from {v['warmup_s']:.0f} s)",
        "",
        "| figure | at 0 s | steady start | end | min | max | slope /min | 2nd-half slope "
        "/min | fitted rise | tolerance | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, label in (("rss_mib", "RSS (MiB)"), ("fds", "open fds"), ("threads", "threads")):
        f = v["fits"][key]
        if f is None:
            continue
        ok = f["fitted_rise"] <= v["tolerances"][key]
        lines.append(
            f"| {label} | {_fmt(first.get(key))} | {_fmt(f['first'])} | {_fmt(f['last'])} "
            f"| {_fmt(f['min'])} | {_fmt(f['max'])} | {f['slope_per_min']:+.2f} "
            f"| {_fmt(f['second_half_slope_per_min'], 2)} | {f['fitted_rise']:+.1f} "
            f"| {v['tolerances'][key]:g} | {_mark(ok)} |"
        )
    rss = v["fits"]["rss_mib"]
    parts = last.get("data_dir_parts_mib", {})
    lines += [
        "",
        f"Peak RSS (VmHWM) {_fmt(last.get('hwm_mib'))} MiB. RSS scatter around the fit: "
        f"{_fmt(rss and rss['residual_std'], 2)} MiB (std). Server CPU time "
        f"{_fmt(last.get('cpu_s', 0) - first.get('cpu_s', 0), 0)} s over the load. Data dir "
        f"{_fmt(first.get('data_dir_mib'), 2)} MiB at the start, {_fmt(last.get('data_dir_mib'), 2)} "
        "at the end (" + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()) + " MiB): the "
        "database grows by one usage row per request (by design); the store is "
        "content-addressed and the churn re-uploads the same pool of adapters.",
        "",
    ]
    return lines


def _md_billing(report: dict) -> list[str]:
    b = report["billing"]
    done, cut = b["completed"], b["dropped"]
    lines = [
        "## Billing",
        "",
        f"`/admin/usage?group_by=request` against what the API returned: {b['requests_billed']} "
        f"requests billed, {b['requests_returned']} returned usage; "
        f"{b['mismatch_count']} requests differ, {len(b['billed_but_not_returned'])} billed "
        f"that no client saw; {b['requests_without_tokens']} delivered no token (a stream "
        "dropped after its first, empty chat chunk) and are not billed, as documented.",
        "",
        f"| completed requests ({done['requests']}) | returned | billed |",
        "|---|---|---|",
    ]
    lines += [f"| {f} | {done['returned'][f]:,} | {done['billed'][f]:,} |" for f in USAGE_FIELDS]
    lines += [
        f"| dropped streams ({cut['requests']}): completion tokens received / billed "
        f"| {cut['tokens_received']:,} | {cut['tokens_billed']:,} |",
        "",
    ]
    return lines


def _md_ending(report: dict) -> list[str]:
    end, db = report["ending"], report["database"]
    shutdown = end["shutdown"]
    return [
        "## Shutdown and what is left",
        "",
        f"SIGTERM after the load: exit status {shutdown['exit_code']} after "
        f"{_fmt(shutdown['seconds'], 2)} s, "
        f"{'graceful (uvicorn finished, then re-raised the signal)' if shutdown['graceful'] else 'NOT graceful'}"
        f"{' (killed)' if shutdown['needed_kill'] else ''}. "
        f"Adapter versions by status: {db['versions_by_status']}; adapters live "
        f"{db['adapters_live']}, deleted {db['adapters_deleted']}; provisional usage rows "
        f"{db['provisional_usage_rows']}; left in tmp/uploads or TMPDIR: "
        f"{end['leftovers'] or 'nothing'}. Error lines in the server log: "
        f"{len(report['server_log_errors'])}; failed samples: {len(report['sample_errors'])}.",
        "",
    ]
