"""What a new report must keep of a recorded result file, so that old and new compare."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def key_paths(value, prefix: str = "") -> set[str]:
    """Every key of nested dicts, as dotted paths (``config.churn_budgets.kv_cache_bytes``)."""
    if not isinstance(value, dict):
        return set()
    return {f"{prefix}{k}" for k in value} | {
        path for k, v in value.items() for path in key_paths(v, f"{prefix}{k}.")
    }


def missing_keys(recorded_file: str, report: dict) -> set[str]:
    """The key paths of ``benchmarks/results/<recorded_file>`` that ``report`` lacks."""
    recorded = json.loads((RESULTS / recorded_file).read_text())
    return key_paths(recorded) - key_paths(report)
