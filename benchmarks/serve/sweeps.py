"""``loramux bench --sweep``: one preset's workload run at several points, loramux only.

* ``adapters``: the workload with ``num_adapters`` set to each value (default 1, 4, 16,
  64); plotted as output tokens/s against the number of adapters;
* ``load``: the workload with its rate multiplied by each value (default 0.5, 1, 2, 4);
  plotted as TTFT P50 / P99 against the offered load in requests/s.

Everything else in the workload (seed, lengths, tenants, request count) is the preset's, so
each point serves the same arrivals' pattern at its own scale. ``run_sweep`` takes the
function that serves one spec and returns ``measures.summarize``-style figures (``bench``
passes its engine driver), so this module does not know how a run is done.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from loramux.benchmarks.common.files import pyplot, save_figure
from loramux.benchmarks.common.workload import WorkloadSpec

SWEEPS: dict[str, tuple[float, ...]] = {
    "adapters": (1, 4, 16, 64),
    "load": (0.5, 1, 2, 4),
}
PLOT_SUFFIX = {"adapters": "_throughput_vs_adapters.png", "load": "_ttft_vs_load.png"}


def point_spec(kind: str, spec: WorkloadSpec, value: float) -> WorkloadSpec:
    """``spec`` at one sweep point."""
    if kind == "adapters":
        count = int(value)
        if count != value or count < 1:
            raise ValueError(f"an adapters sweep needs whole counts >= 1, got {value}")
        return dataclasses.replace(spec, num_adapters=count)
    if kind == "load":
        return dataclasses.replace(spec, rate=spec.rate * value)
    raise ValueError(f"unknown sweep {kind!r}; one of {sorted(SWEEPS)}")


def run_sweep(
    kind: str,
    spec: WorkloadSpec,
    run_once: Callable[[WorkloadSpec], dict],
    values: Sequence[float] | None = None,
) -> dict:
    """Run ``spec`` at each point of ``kind``; JSON-able ``{"kind", "driver", "values",
    "points"}``, one point per value with its figures (latency samples left out)."""
    values = list(values or SWEEPS[kind])
    points = []
    for value in values:
        point = point_spec(kind, spec, value)
        print(
            f"sweep {kind} = {value:g}: {point.num_requests} requests, "
            f"{point.num_adapters} adapters, {point.rate:g} req/s ...",
            flush=True,
        )
        figures = run_once(point)
        figures.pop("samples", None)
        points.append(
            {
                "value": value,
                "num_adapters": point.num_adapters,
                "offered_rate": point.rate,
                "figures": figures,
            }
        )
    return {"kind": kind, "driver": "engine", "values": values, "points": points}


def write_plots(sweeps: dict, preset: str, stem: Path) -> list[Path]:
    """One PNG per sweep next to ``stem``: ``<stem>_throughput_vs_adapters.png`` and
    ``<stem>_ttft_vs_load.png``."""
    plt = pyplot() if sweeps else None
    if plt is None:
        return []

    paths = []
    for kind, sweep in sweeps.items():
        points = sweep["points"]
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        if kind == "adapters":
            xs = [p["num_adapters"] for p in points]
            ys = [p["figures"]["output_tokens_per_s"] for p in points]
            ax.plot(xs, ys, marker="o", label="loramux (engine)")
            if len(set(xs)) > 1 and min(xs) > 0 and max(xs) / min(xs) >= 8:
                ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_xlabel("number of adapters")
            ax.set_ylabel("output tokens/s")
            ax.set_ylim(bottom=0)
            ax.set_title(f"{preset}: throughput vs number of adapters")
        else:
            xs = [p["offered_rate"] for p in points]
            for key, style in (("p50", "o-"), ("p99", "s--")):
                ys = [_ms_or_none(p["figures"]["ttft_s"][key]) for p in points]
                ax.plot(xs, ys, style, label=f"TTFT {key.upper()}")
            ax.set_xlabel("offered load (requests/s)")
            ax.set_ylabel("time to first token (ms)")
            ax.set_ylim(bottom=0)
            ax.set_title(f"{preset}: TTFT vs offered load")
        n = points[0]["figures"]["requests"]["total"] if points else 0
        ax.grid(alpha=0.3)
        ax.legend()
        path = stem.with_name(stem.name + PLOT_SUFFIX[kind])
        paths.append(save_figure(fig, path, note=f"{n} requests per point, loramux engine driver"))
    return paths


def _ms_or_none(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000
