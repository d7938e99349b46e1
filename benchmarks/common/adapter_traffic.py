"""The engine's adapter traffic, read from its Prometheus registry: hits and misses per
tier, loads, evictions per tier, load time and preemptions. Differences of two readings
(``traffic_between``) are what a run did."""

from __future__ import annotations

# (key, sample name, labels)
COUNTERS = (
    ("device_hits", "loramux_adapter_hits_total", (("tier", "device"),)),
    ("device_misses", "loramux_adapter_misses_total", (("tier", "device"),)),
    ("host_hits", "loramux_adapter_hits_total", (("tier", "host"),)),
    ("host_misses", "loramux_adapter_misses_total", (("tier", "host"),)),
    ("loads", "loramux_adapter_loads_total", ()),
    ("device_evictions", "loramux_adapter_evictions_total", (("tier", "device"),)),
    ("host_evictions", "loramux_adapter_evictions_total", (("tier", "host"),)),
    ("load_seconds_sum", "loramux_adapter_load_seconds_sum", ()),
    ("load_seconds_count", "loramux_adapter_load_seconds_count", ()),
    ("preemptions", "loramux_preemptions_total", ()),
)


def read_counters(engine) -> dict[str, float]:
    registry = engine.metrics.registry
    return {
        key: registry.get_sample_value(sample, dict(labels)) or 0.0
        for key, sample, labels in COUNTERS
    }


def traffic_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in before}
