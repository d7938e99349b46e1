"""The platform's settings and the engine's config cannot drift apart.

Every ``EngineConfig`` field is copied from a setting, set by the platform, or left at the
engine's default on purpose (``platform/engine_settings.py``); a field added to the engine
without a decision there fails here. Copied fields have the engine's default as their own,
and a value set in the environment reaches the engine.
"""

from __future__ import annotations

import dataclasses

import pytest

from loramux.engine import EngineConfig
from loramux.platform.base_model import ResolvedBaseModel
from loramux.platform.engine_settings import (
    ENGINE_DEFAULTS,
    FROM_SETTINGS,
    SET_BY_THE_PLATFORM,
    engine_config,
)
from loramux.platform.settings import Settings, setting_fields

ENGINE_FIELDS = {field.name: field for field in dataclasses.fields(EngineConfig)}


def test_every_engine_field_has_one_decision():
    tables = (FROM_SETTINGS, SET_BY_THE_PLATFORM, ENGINE_DEFAULTS)
    decided = [name for table in tables for name in table]
    assert len(decided) == len(set(decided)), "a field is in two tables"
    missing = set(ENGINE_FIELDS) - set(decided)
    assert not missing, f"EngineConfig fields with no decision in engine_settings: {missing}"
    assert not set(decided) - set(ENGINE_FIELDS), "a table names a field EngineConfig lacks"
    assert all(ENGINE_DEFAULTS.values()) and all(SET_BY_THE_PLATFORM.values())


@pytest.mark.parametrize(("field", "setting"), sorted(FROM_SETTINGS.items()))
def test_a_copied_setting_has_the_engines_default(field, setting):
    assert setting in setting_fields(), f"Settings has no {setting}"
    assert setting_fields()[setting].default == ENGINE_FIELDS[field].default


def test_settings_reach_the_engine(tmp_path, monkeypatch):
    for name, value in {
        "LORAMUX_MAX_ADAPTER_RANK": "128",
        "LORAMUX_ENGINE_MAX_NUM_SEQS": "7",
        "LORAMUX_ENGINE_MAX_PREFILL_CHUNK": "96",
        "LORAMUX_ENGINE_MAX_ADAPTERS_PER_STEP": "3",
        "LORAMUX_ENGINE_ENABLE_PREFIX_CACHING": "false",
        "LORAMUX_ENGINE_DTYPE": "bfloat16",
        "LORAMUX_ENGINE_KV_CACHE_DTYPE": "fp8",
        "LORAMUX_ENGINE_ADAPTER_DISK_CACHE_BYTES": str(1 << 30),
    }.items():
        monkeypatch.setenv(name, value)
    config = engine_config(
        Settings(data_dir=tmp_path), ResolvedBaseModel(path=tmp_path, model_id="m")
    )
    assert config.max_lora_rank == 128
    assert (config.max_num_seqs, config.max_prefill_chunk, config.max_adapters_per_step) == (
        7,
        96,
        3,
    )
    assert config.enable_prefix_caching is False and config.dtype == "bfloat16"
    assert config.kv_cache_dtype == "fp8"
    assert config.adapter_disk_cache_dir == str(tmp_path / "adapter-cache")
    assert config.adapter_disk_cache_bytes == 1 << 30
    assert config.model == str(tmp_path)


def test_without_a_disk_cache_setting_there_is_no_disk_tier(tmp_path, monkeypatch):
    monkeypatch.delenv("LORAMUX_ENGINE_ADAPTER_DISK_CACHE_BYTES", raising=False)
    config = engine_config(
        Settings(data_dir=tmp_path), ResolvedBaseModel(path=tmp_path, model_id="m")
    )
    assert config.adapter_disk_cache_dir is None


def test_grammar_cache_budgets_reach_the_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAMUX_ENGINE_GRAMMAR_CACHE_BYTES", str(64 << 20))
    monkeypatch.setenv("LORAMUX_ENGINE_GRAMMAR_CACHE_TENANT_BYTES", str(8 << 20))
    config = engine_config(
        Settings(data_dir=tmp_path), ResolvedBaseModel(path=tmp_path, model_id="m")
    )
    assert (config.grammar_cache_bytes, config.grammar_cache_tenant_bytes) == (64 << 20, 8 << 20)
