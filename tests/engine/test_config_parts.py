"""EngineConfig by concern: every field in exactly one part, each part checked on its own."""

from __future__ import annotations

import dataclasses
import math

import pytest

from loramux.engine import EngineConfig
from loramux.engine.config_parts import PARTS, CacheConfig, ParallelConfig


def test_every_field_belongs_to_exactly_one_part():
    fields = [f.name for f in dataclasses.fields(EngineConfig)]
    owners = {
        name: [p for p, part in PARTS.items() if name in part.__dataclass_fields__]
        for name in fields
    }
    assert {name: parts for name, parts in owners.items() if len(parts) != 1} == {}
    in_parts = sum(len(part.__dataclass_fields__) for part in PARTS.values())
    assert in_parts == len(fields)  # and no part has a field EngineConfig lacks


def test_the_parts_carry_the_configs_values():
    config = EngineConfig(model="m", block_size=32, tensor_parallel_size=2, kernels="torch")
    for name, part in PARTS.items():
        value = getattr(config, name)
        assert isinstance(value, part)
        for field in dataclasses.fields(part):
            assert getattr(value, field.name) == getattr(config, field.name)
    assert config.cache.block_size == 32 and config.parallel.tensor_parallel_size == 2


def test_a_part_is_checked_on_its_own_with_the_configs_field_names():
    cache = dataclasses.asdict(EngineConfig(model="m").cache)
    with pytest.raises(ValueError, match=r"EngineConfig\.adapter_device_bytes \(2\) is a share"):
        CacheConfig(**{**cache, "kv_cache_bytes": 1, "adapter_device_bytes": 2})
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        ParallelConfig(
            tensor_parallel_size=2,
            tensor_parallel_timeout_s=5,
            tensor_parallel_heartbeat_timeout_s=5,
        )
    # Through EngineConfig, the same part's check.
    with pytest.raises(ValueError, match=r"EngineConfig\.kernels must be one of"):
        EngineConfig(model="m", kernels="cuda")


def test_an_infinite_prefill_target_is_no_time_target_on_any_device():
    assert EngineConfig(model="m", device="cpu").step_target_s == 0.12
    assert (
        EngineConfig(model="m", device="cpu", prefill_step_target_s=math.inf).step_target_s is None
    )
    assert EngineConfig(model="m", device="cpu", prefill_step_target_s=0.5).step_target_s == 0.5
