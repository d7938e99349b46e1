"""The engine's settings are nested as its config is, and one field there exposes one.

``Settings.engine.<part>.<field>`` mirrors ``EngineConfig``'s parts; the variable is the
flat ``LORAMUX_ENGINE_<FIELD>``; flat keywords still work and beat the environment."""

from __future__ import annotations

import dataclasses
import os

import pytest
from pydantic import ValidationError

from loramux.engine.config_parts import PARTS
from loramux.platform.engine_settings import FROM_SETTINGS, SET_BY_THE_PLATFORM
from loramux.platform.settings import Settings, setting_fields
from loramux.platform.settings_engine import PART_MODELS, PART_OF
from loramux.platform.settings_names import env_name


@pytest.fixture
def clean_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("LORAMUX_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_the_parts_mirror_the_engines_config():
    assert set(PART_MODELS) <= set(PARTS)
    for part, model in PART_MODELS.items():
        engine_fields = {f.name for f in dataclasses.fields(PARTS[part])}
        assert set(model.model_fields) <= engine_fields, part


def test_every_engine_setting_reaches_the_engine_or_is_derived():
    for field in PART_OF:
        assert field in FROM_SETTINGS or field in SET_BY_THE_PLATFORM, field
        assert env_name(field) == f"LORAMUX_ENGINE_{field.upper()}"
        assert field in setting_fields()


def test_a_variable_flat_keywords_and_nested_keywords_set_the_same_field(tmp_path, clean_env):
    clean_env.setenv("LORAMUX_ENGINE_MAX_NUM_SEQS", "7")
    assert Settings(data_dir=tmp_path).engine.scheduler.max_num_seqs == 7
    assert Settings(data_dir=tmp_path, max_num_seqs=3).engine.scheduler.max_num_seqs == 3
    nested = Settings(data_dir=tmp_path, engine={"scheduler": {"max_num_seqs": 5}})
    assert nested.engine.scheduler.max_num_seqs == 5
    # The rest of the part keeps what the environment and the defaults say.
    clean_env.setenv("LORAMUX_ENGINE_ADAPTER_WAIT_STEPS", "4")
    both = Settings(data_dir=tmp_path, max_num_seqs=2)
    assert (both.engine.scheduler.max_num_seqs, both.engine.scheduler.adapter_wait_steps) == (2, 4)
    assert both.engine.scheduler.max_num_batched_tokens == 2048


def test_a_bad_engine_value_is_refused_naming_the_field(tmp_path, clean_env):
    clean_env.setenv("LORAMUX_ENGINE_KV_CACHE_BYTES", "-1")
    with pytest.raises(ValidationError, match=r"engine\.cache\.kv_cache_bytes"):
        Settings(data_dir=tmp_path)
    with pytest.raises(ValidationError, match=r"max_num_seqs"):
        Settings(data_dir=tmp_path, max_num_seqs=0)
    with pytest.raises(ValidationError, match=r"no_such_field"):
        Settings(data_dir=tmp_path, engine={"cache": {"no_such_field": 1}})
