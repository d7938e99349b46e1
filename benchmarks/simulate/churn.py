"""``simulate churn``: S-LoRA's trace over working sets from 0.5x to 4x of what the device
holds, each against the same trace with every adapter resident.

The device's adapter room is capped (``adapter_device_bytes``) at ``capacity`` adapters of
the setting's rank mix (adapter ``k`` of rank ``ranks[k % len(ranks)]``), every adapter in
host RAM at the start (S-LoRA's setting); the working set is the number of distinct
adapters the trace draws from. The all-resident run is the stricter reference: the same
trace on a device with room for every adapter *beside* the same KV memory (the adapters'
bytes added to ``kv_cache_bytes``, no cap, every adapter loaded before the clock starts),
so its figures carry no adapter cost but the kernels'. A cliff shows as the capped run's
TTFT pulling away from it as the working set passes the capacity.
"""

from __future__ import annotations

import json
from pathlib import Path

from loramux.benchmarks.common.files import pyplot, save_figure
from loramux.benchmarks.common.report import Markdown
from loramux.benchmarks.common.slora_workloads import SETTINGS, adapter_rank, slora_requests
from loramux.benchmarks.simulate.runs import per_minute_cell
from loramux.benchmarks.simulate.serve import engine_config, model_dir, model_of, serve
from loramux.engine.model.llama import LORA_TARGETS
from loramux.engine.simulation.adapters import adapter_bytes
from loramux.engine.simulation.profile import DeviceProfile

CHURN_FACTORS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)
DEFAULT_CAPACITY = 100  # adapters: S-LoRA's table's middle count
CHURN_DURATION_S = 60.0
# The bounds at 2x the capacity: TTFT over the all-resident run's.
CLIFF_FACTOR, P50_BOUND, P99_BOUND = 2.0, 3.0, 5.0


def churn_sweep(
    setting_name: str,
    profile: DeviceProfile,
    cache_dir: Path,
    tokenizer_dir: Path,
    *,
    capacity: int = DEFAULT_CAPACITY,
    factors: tuple[float, ...] = CHURN_FACTORS,
    rate: float | None = None,
    duration_s: float = CHURN_DURATION_S,
) -> dict:
    """Each factor's working set served capped at ``capacity`` adapters and all-resident."""
    setting = SETTINGS[setting_name]
    rate = setting.rate if rate is None else rate
    model = model_dir(cache_dir, f"{setting_name.lower()}-model", setting.model, tokenizer_dir)
    base = engine_config(model)
    shapes, itemsize = model_of(base), base.torch_dtype.itemsize

    def device_bytes(count: int) -> int:
        """Device bytes of adapters 0..count-1 in the pool's rows (every module's width)."""
        return sum(
            adapter_bytes(shapes, adapter_rank(setting, k), LORA_TARGETS, itemsize)
            for k in range(count)
        )

    cap_bytes = device_bytes(capacity)
    rows = []
    for factor in factors:
        working_set = max(1, round(factor * capacity))
        requests = slora_requests(setting, working_set, rate=rate, duration_s=duration_s)
        ranks = [adapter_rank(setting, k) for k in range(working_set)]
        capped = serve(
            engine_config(model, adapter_device_bytes=cap_bytes),
            profile,
            requests,
            ranks,
            vocab_size=setting.model["vocab_size"],
            host_resident=True,
        ).figures()
        resident = serve(
            engine_config(model, kv_cache_bytes=base.kv_cache_bytes + device_bytes(working_set)),
            profile,
            requests,
            ranks,
            vocab_size=setting.model["vocab_size"],
            host_resident=True,
            preload=True,
        ).figures()
        rows.append(
            {
                "factor": factor,
                "working_set": working_set,
                "capped": capped,
                "all_resident": resident,
                "ttft_p50_ratio": capped["ttft_p50_s"] / resident["ttft_p50_s"],
                "ttft_p99_ratio": capped["ttft_p99_s"] / resident["ttft_p99_s"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return {
        "setting": setting_name,
        "offered_rate": rate,
        "duration_s": duration_s,
        "capacity_adapters": capacity,
        "capacity_bytes": cap_bytes,
        "profile": profile.name,
        "label": profile.describe(),
        "rows": rows,
        "verdict": verdict(rows),
    }


def verdict(rows: list[dict]) -> dict | None:
    """The bounds at twice the capacity: None when the sweep did not run that factor."""
    at = next((r for r in rows if r["factor"] == CLIFF_FACTOR), None)
    if at is None:
        return None
    return {
        "factor": CLIFF_FACTOR,
        "ttft_p50_ratio": at["ttft_p50_ratio"],
        "ttft_p50_bound": P50_BOUND,
        "ttft_p99_ratio": at["ttft_p99_ratio"],
        "ttft_p99_bound": P99_BOUND,
        "met": at["ttft_p50_ratio"] <= P50_BOUND and at["ttft_p99_ratio"] <= P99_BOUND,
    }


def churn_markdown(report: dict, plot: Path | None) -> str:
    md = Markdown(
        f"Churn cliff: S-LoRA {report['setting']} on a simulated GPU ({report['profile']})"
    )
    md.text(
        f"**Simulated: {report['label']}.** S-LoRA's trace at {report['offered_rate']:g} req/s "
        f"for {report['duration_s']:g} s over working sets of 0.5x to 4x the device's adapter "
        f"room, capped at {report['capacity_adapters']} adapters of the rank mix "
        f"({report['capacity_bytes'] / 2**30:.1f} GiB of the shared memory); every adapter in "
        "host RAM at the start. The all-resident reference serves the same trace with every "
        "adapter on a device with room for them beside the same KV memory."
    ).command(report.get("command", ""))
    rows = []
    for row in report["rows"]:
        c, r = row["capped"], row["all_resident"]
        rows.append(
            (
                f"{row['factor']:g}x",
                f"{row['working_set']:,}",
                f"{c['ttft_p50_s']:.3f} ({r['ttft_p50_s']:.3f})",
                f"{row['ttft_p50_ratio']:.2f}",
                f"{c['ttft_p99_s']:.2f} ({r['ttft_p99_s']:.2f})",
                f"{row['ttft_p99_ratio']:.2f}",
                f"{c['requests_per_s']:.2f} ({r['requests_per_s']:.2f})",
                per_minute_cell(c["per_minute"]),
            )
        )
    columns = (
        "working set",
        "adapters",
        "TTFT P50 s (all-resident)",
        "ratio",
        "TTFT P99 s (all-resident)",
        "ratio",
        "req/s (all-resident)",
        "re-loads / evictions / room waits / preemptions per min",
    )
    md.table(columns, rows, "rrrrrrrl")
    v = report.get("verdict")
    if v is not None:
        md.text(
            f"At {v['factor']:g}x the capacity (simulated): median TTFT {v['ttft_p50_ratio']:.2f}x "
            f"the all-resident run's (bound {v['ttft_p50_bound']:g}x), P99 "
            f"{v['ttft_p99_ratio']:.2f}x (bound {v['ttft_p99_bound']:g}x): "
            + ("within both bounds." if v["met"] else "**outside the bounds**.")
        )
    if plot is not None:
        md.lines(f"![TTFT against the working set]({plot.name})")
    return md.render()


def churn_plot(report: dict, path: Path) -> Path | None:
    """Median and P99 TTFT against the working set, capped and all-resident, log-scaled."""
    plt = pyplot()
    if plt is None:
        return None
    rows = report["rows"]
    x = [r["factor"] for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for key, label, style in (("ttft_p50_s", "median", "-"), ("ttft_p99_s", "P99", "--")):
        capped = f"{label}, capped at {report['capacity_adapters']} adapters"
        ax.plot(x, [r["capped"][key] for r in rows], "o" + style, color="C3", label=capped)
        resident = [r["all_resident"][key] for r in rows]
        ax.plot(x, resident, "s" + style, color="C0", label=f"{label}, all resident")
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("working set / adapters the device holds")
    ax.set_ylabel("time to first token (s, simulated)")
    ax.set_yscale("log")
    ax.set_title(
        f"S-LoRA {report['setting']} at {report['offered_rate']:g} req/s: TTFT as the working "
        "set outgrows the device"
    )
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    # The label's calibration, to its first colon: the figure's note is one line.
    calibration = report["label"].split("calibration: ", 1)[-1].split(":", 1)[0]
    note = f"SIMULATED on profile {report['profile']} ({calibration}; see the report)"
    return save_figure(fig, path, note=note)
